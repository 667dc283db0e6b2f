"""OpenAI request bodies (pydantic), and their conversion to api.GenerateRequest (from_openai).

Field names, types and ranges follow the OpenAI API reference (the sampling limits are the engine's own,
betelgeuse/sampling.py, so gRPC refuses the same values); vLLM's extras (top_k, min_p, repetition_penalty,
chat_template_kwargs, stop_token_ids, ignore_eos, cache_salt, structured_outputs and its older guided_json /
guided_regex / guided_choice / guided_grammar spellings) are honoured too. Every other field is refused with a 400
naming it: an unknown one ("unknown parameter: x"), and one we know and cannot honour (n > 1, logit_bias,
min_tokens > 0, audio, prediction, web_search_options, functions, ...). OpenAI's bookkeeping fields that change
nothing in the output (user, metadata, store, service_tier, prompt_cache_key, safety_identifier, verbosity) are
accepted and unused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from betelgeuse import api
from betelgeuse.errors import InvalidRequestError
from betelgeuse.api import MAX_STOP, MAX_TEMPERATURE, MAX_TOP_LOGPROBS


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Model):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None     # accepted (some agent frameworks mark parts): nothing to do


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"                       # JSON text (OpenAI's shape)


class ToolCallIn(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, dict[str, Any]]], None] = None
    reasoning_content: str | None = None        # an earlier answer's reasoning (the template decides whether it shows)
    reasoning: str | None = None                # vLLM's newer name for the same
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None                  # an earlier answer's fields, replayed by clients: unused
    annotations: list[Any] | None = None


class FunctionDef(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` extension: exactly one of a JSON schema, a regex, a Lark grammar, a choice."""
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None


def structured_grammar(so: StructuredOutputs | None, field: str = "structured_outputs") -> api.Grammar | None:
    if so is None:
        return None
    given = [k for k in ("json_", "regex", "grammar", "choice") if getattr(so, k) is not None]
    if len(given) != 1:
        raise UnsupportedParam(field, f"{field} needs exactly one of json, regex, grammar, choice")
    if so.json_ is not None:
        import json
        try:
            schema = json.loads(so.json_) if isinstance(so.json_, str) else so.json_
        except ValueError:
            raise UnsupportedParam(field, f"{field}: the JSON schema is not valid JSON") from None
        return api.Grammar("json_schema", schema)
    if so.regex is not None:
        return api.Grammar("regex", so.regex)
    if so.grammar is not None:
        return api.Grammar("lark", so.grammar)
    import re
    return api.Grammar("regex", "|".join(re.escape(c) for c in so.choice))


class StreamOptions(_Model):
    include_usage: bool = False


Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _Sampling(_Model):
    model: str
    temperature: Temperature | None = None      # OpenAI's default: 1
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None          # vLLM: -1 or 0 = off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_STOP)], None] = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(max_length=256)] | None = None   # vLLM's: a separate prefix cache per salt
    min_tokens: Annotated[int, Field(ge=0)] | None = None              # vLLM's: refused unless 0
    # vLLM's structured output: structured_outputs, and the older spellings of its four kinds
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # OpenAI's bookkeeping: accepted, changes nothing in the output
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None   # none: no thinking
    verbosity: Literal["low", "medium", "high"] | None = None       # accepted, unused
    modalities: list[Literal["text"]] | None = None                  # text only
    # known, and refused when given (see REFUSED)
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[str], Field(min_length=1, max_length=1)],
                  Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None     # legacy: the number of top alternatives
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    parse_special: bool = False                 # ours: special-token text in the prompt becomes control tokens


class TokenizeRequest(_Model):
    content: str
    add_special: bool = False
    parse_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Model):
    tokens: list[Annotated[int, Field(ge=0)]]


# ---- conversion ------------------------------------------------------------------------------------------------


class UnsupportedParam(InvalidRequestError):
    """A known OpenAI field whose value we cannot honour (HTTP 400, param = the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


REFUSED = {"audio": "audio output is not supported (text only)",
           "prediction": "predicted outputs are not supported",
           "web_search_options": "web search is not supported",
           "functions": "functions (deprecated) is not supported: send tools",
           "function_call": "function_call (deprecated) is not supported: send tool_choice"}
GUIDED = {"guided_json": "json_", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _grammar(r: _Sampling) -> api.Grammar | None:
    """structured_outputs, or one of vLLM's older guided_* fields (the same four kinds); not both."""
    guided = [k for k in GUIDED if getattr(r, k) is not None]
    if guided and r.structured_outputs is not None:
        raise UnsupportedParam(guided[0], f"give structured_outputs or {guided[0]}, not both")
    if len(guided) > 1:
        raise UnsupportedParam(guided[1], f"give one of {', '.join(guided)}, not several")
    if guided:
        so = StructuredOutputs.model_validate({GUIDED[guided[0]].rstrip("_"): getattr(r, guided[0])})
        return structured_grammar(so, guided[0])
    return structured_grammar(r.structured_outputs)


def _common(r: _Sampling) -> dict:
    for name, why in REFUSED.items():
        if getattr(r, name, None) is not None:
            raise UnsupportedParam(name, f"{name}: {why}")
    if r.n not in (None, 1):
        raise UnsupportedParam("n", "n must be 1 (one choice per request)")
    if r.logit_bias:
        raise UnsupportedParam("logit_bias", "logit_bias is not supported")
    if r.min_tokens:
        raise UnsupportedParam("min_tokens", "min_tokens is not supported (only 0): the answer may end at any token")
    top_k = r.top_k or 0
    return dict(
        sampling=api.SamplingParams(
            temperature=1.0 if r.temperature is None else r.temperature,
            top_k=0 if top_k < 0 else top_k, top_p=1.0 if r.top_p is None else r.top_p, seed=r.seed,
            min_p=r.min_p or 0.0, presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty),
        stop=[r.stop] if isinstance(r.stop, str) else list(r.stop or []),
        stop_token_ids=list(r.stop_token_ids or []), ignore_eos=r.ignore_eos, cache_salt=r.cache_salt or "")


def _content(m: Message) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    out = []
    for part in m.content:
        if isinstance(part, TextPart):
            out.append(part.text)
        else:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                extra = sorted(set(part) - set(TextPart.model_fields))
                raise UnsupportedParam("messages", f"unknown parameter in a text content part: {', '.join(extra) or 'text'}"
                                       if extra else "a text content part needs a string text")
            raise UnsupportedParam("messages", f"content part type {kind!r} is not supported (text only)")
    return "".join(out)


def chat_request(r: ChatCompletionRequest) -> api.GenerateRequest:
    kw = _common(r)
    messages = []
    for m in r.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m)}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.role == "assistant" and (m.reasoning_content or m.reasoning):
            d["reasoning_content"] = m.reasoning_content or m.reasoning
        if m.name:
            d["name"] = m.name
        messages.append(d)
    grammar = None
    rf = r.response_format
    if rf is not None and rf.type == "json_object":
        grammar = api.Grammar("json_object")
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise UnsupportedParam("response_format", "response_format json_schema needs json_schema.schema")
        grammar = api.Grammar("json_schema", rf.json_schema.schema_)
    so = _grammar(r)
    if so is not None:
        if grammar is not None:
            raise UnsupportedParam("structured_outputs", "give response_format or structured_outputs, not both")
        grammar = so
    tc = r.tool_choice
    choice = tc.model_dump() if isinstance(tc, NamedToolChoice) else tc
    kw["sampling"].logprobs = r.logprobs or bool(r.top_logprobs)
    kw["sampling"].top_logprobs = r.top_logprobs or 0
    template_kwargs = dict(r.chat_template_kwargs or {})
    if r.reasoning_effort is not None:           # as Responses' reasoning.effort: "none" turns thinking off
        template_kwargs.setdefault("enable_thinking", r.reasoning_effort != "none")
        template_kwargs.setdefault("thinking", r.reasoning_effort != "none")
    return api.GenerateRequest(
        messages=messages, max_tokens=r.max_completion_tokens or r.max_tokens,
        tools=[t.model_dump(exclude_none=True) for t in r.tools] if r.tools else None,
        tool_choice=choice, chat_template_kwargs=template_kwargs, grammar=grammar, **kw)


def completion_request(r: CompletionRequest) -> api.GenerateRequest:
    kw = _common(r)
    if r.echo:
        raise UnsupportedParam("echo", "echo is not supported")
    if r.suffix:
        raise UnsupportedParam("suffix", "suffix (fill-in-the-middle) is not supported")
    if r.best_of not in (None, 1):
        raise UnsupportedParam("best_of", "best_of must be 1")
    p = r.prompt
    text, ids = (p, None) if isinstance(p, str) else (p[0], None) if isinstance(p[0], str) else (None, list(p))
    if r.logprobs is not None:
        kw["sampling"].logprobs, kw["sampling"].top_logprobs = True, r.logprobs
    return api.GenerateRequest(prompt_text=text, prompt_ids=ids, max_tokens=r.max_tokens,
                               parse_special=r.parse_special, grammar=_grammar(r), **kw)
