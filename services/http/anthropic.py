"""The Anthropic Messages API over the same engine: `POST /v1/messages` and `POST /v1/messages/count_tokens`, so
that Claude-style agents (ANTHROPIC_BASE_URL) can talk to Betelgeuse.

    system (string or text blocks), messages with text / tool_use / tool_result / thinking blocks, tools
    (input_schema) and tool_choice (auto | any | tool | none), stop_sequences, max_tokens, temperature, top_p,
    top_k, thinking (enabled | disabled -> the template's thinking switch), stream (message_start, ping,
    content_block_start / _delta / _stop, message_delta, message_stop), usage with cache_read_input_tokens from the
    prefix cache. The x-api-key header carries the API key where keys are configured (services/http/app.py checks it
    for every path); anthropic-version is accepted.

Refused with a 400 naming them, as Anthropic's API does with unknown input: any field this module does not know,
and known features it cannot honour (image / document / search-result blocks, server tools such as web search,
mcp_servers, container). Errors have Anthropic's shape {"type": "error", "error": {"type", "message"}}.
`thinking.budget_tokens` is accepted and not enforced (max_tokens bounds the whole answer, reasoning included).
max_tokens is an upper bound here: the answer also ends at the end of the context (stop_reason "max_tokens"),
since Anthropic clients send their own large max_tokens (Claude Code: 32000) whatever the served model's context.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

import anyio
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from betelgeuse import api
from services.http import output
from services.http.errors import ANTHROPIC_PREFIX, anthropic_body, anthropic_type, classify
from services.http.protocol import MAX_STOP, StructuredOutputs, UnsupportedParam, structured_grammar

PREFIX = ANTHROPIC_PREFIX

ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None     # omitted: thinking blocks come back empty


class JsonFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None   # "max": DeepSeek-V4's max effort
    format: JsonFormat | None = None


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class MessagesRequest(_Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None              # accepted, not used: user_id
    service_tier: str | None = None                     # accepted, not used: one tier, one speed, one place
    speed: str | None = None
    inference_geo: str | None = None
    cache_control: dict[str, Any] | None = None         # accepted: the prefix cache needs no markers
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: Any = None                               # refused when given (no code-execution containers)
    mcp_servers: Any = None                             # refused when given (no MCP connector)
    # ours / vLLM's extensions
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- request -> api.GenerateRequest ------------------------------------------------------------------------------

BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _text_of(blocks, where: str) -> str:
    """The text of a string or a list of text blocks (system, tool_result content)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text" or not isinstance(b.get("text"), str):
            raise UnsupportedParam(f"{where}.{j}", f"{where}.{j}: block type {kind!r} is not supported here (text only)")
        out.append(b["text"])
    return "\n".join(out)


def _messages(r) -> list[dict]:
    """Anthropic's turns -> the chat template's messages (tool_use -> tool_calls, tool_result -> tool messages)."""
    msgs: list[dict] = []
    if r.system:
        msgs.append({"role": "system", "content": _text_of(r.system, "system")})
    for i, m in enumerate(r.messages):
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results, thought = [], [], [], None
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind not in BLOCKS:
                raise UnsupportedParam(where, f"{where}: content block type {kind!r} is not supported "
                                              f"({', '.join(BLOCKS)})")
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise UnsupportedParam(where, f"{where}.text must be a string")
                texts.append(b["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise UnsupportedParam(where, f"{where}: tool_use needs a name and an input object")
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m.role == "user":
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                "content": _text_of(b.get("content"), f"{where}.content")})
            elif kind == "thinking" and m.role == "assistant":
                thought = b.get("thinking") if isinstance(b.get("thinking"), str) else None
            elif kind != "redacted_thinking":
                raise UnsupportedParam(where, f"{where}: a {kind} block cannot be in a {m.role} message")
        msgs += results
        if m.role == "assistant":
            d: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                d["tool_calls"] = calls
            if thought:
                d["reasoning_content"] = thought
            msgs.append(d)
        elif texts or not results:
            msgs.append({"role": "user", "content": "\n".join(texts)})
    return msgs


def _tools(r) -> tuple[list[dict] | None, Any]:
    tools = None
    if r.tools:
        tools = []
        for i, t in enumerate(r.tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind not in (None, "custom"):
                raise UnsupportedParam(f"tools.{i}", f"tools.{i}: tool type {kind!r} is not supported (only "
                                                     "custom tools with an input_schema)")
            try:
                d = ToolDef.model_validate(t)
            except Exception as e:       # noqa: BLE001 (pydantic's ValidationError: one line naming the field)
                raise UnsupportedParam(f"tools.{i}", f"tools.{i}: {str(e).splitlines()[-1].strip()}") from None
            tools.append({"type": "function", "function": {"name": d.name, "description": d.description or "",
                                                            "parameters": d.input_schema}})
    tc, choice = r.tool_choice, None
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise UnsupportedParam("tool_choice", "tool_choice of type tool needs a name")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
        if not tools and tc.type in ("any", "tool"):
            raise UnsupportedParam("tool_choice", f"tool_choice {tc.type!r} needs tools")
    return tools, choice


def _template_kwargs(r) -> dict:
    """thinking -> the template's switches (Qwen3's enable_thinking, DeepSeek-V4's thinking); "adaptive" and
    "between_tools" leave the template's default; output_config.effort "max" -> DeepSeek-V4's reasoning_effort."""
    kw = dict(r.chat_template_kwargs or {})
    if r.thinking is not None and r.thinking.type in ("enabled", "disabled"):
        on = r.thinking.type == "enabled"
        kw.setdefault("enable_thinking", on)
        kw.setdefault("thinking", on)
    oc = getattr(r, "output_config", None)
    if oc is not None and oc.effort == "max":
        kw.setdefault("reasoning_effort", "max")
    return kw


def to_request(r: MessagesRequest) -> api.GenerateRequest:
    for name in ("container", "mcp_servers"):
        if getattr(r, name) is not None:
            raise UnsupportedParam(name, f"{name} is not supported by this server")
    tools, choice = _tools(r)
    grammar = structured_grammar(r.structured_outputs)
    if r.output_config is not None and r.output_config.format is not None:
        if grammar is not None:
            raise UnsupportedParam("output_config.format", "give output_config.format or structured_outputs, not both")
        grammar = api.Grammar("json_schema", r.output_config.format.schema_)
    return api.GenerateRequest(
        messages=_messages(r), max_tokens=r.max_tokens, fit_context=True, stop=list(r.stop_sequences or []),
        sampling=api.SamplingParams(temperature=1.0 if r.temperature is None else r.temperature,
                                    top_p=1.0 if r.top_p is None else r.top_p, top_k=r.top_k or 0),
        tools=tools, tool_choice=choice, chat_template_kwargs=_template_kwargs(r), grammar=grammar)


# ---- responses -----------------------------------------------------------------------------------------------------

def _tool_id(call: api.ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _stop(ans_finish: str, final: api.FinalEvent) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words."""
    if ans_finish == "tool_calls":
        return "tool_use", None
    if ans_finish == "length":
        return "max_tokens", None
    if final.stop_reason == "stop_string":
        return "stop_sequence", final.stop_string
    return "end_turn", None


def _usage(u: api.Usage, n_out: int) -> dict:
    """Anthropic's input_tokens excludes what was read from the cache (their sum is the prompt)."""
    return {"input_tokens": u.prompt_n - u.cached_tokens, "output_tokens": n_out,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def _tool_block(call: api.ToolCall, with_input: bool = True) -> dict:
    return {"type": "tool_use", "id": _tool_id(call), "name": call.name,
            "input": json.loads(call.arguments) if with_input else {}}


def _shown(body: MessagesRequest) -> bool:
    return not (body.thinking is not None and body.thinking.display == "omitted")


def full_response(body: MessagesRequest, req: api.GenerateRequest, ans: output.Answer) -> dict:
    blocks: list[dict] = []
    if ans.reasoning:
        blocks.append({"type": "thinking", "thinking": ans.reasoning if _shown(body) else "", "signature": ""})
    if ans.content or not (ans.calls or ans.reasoning):
        blocks.append({"type": "text", "text": ans.content})
    blocks += [_tool_block(c) for c in ans.calls]
    reason, seq = _stop(ans.finish_reason, ans.final)
    return {"id": f"msg_{req.request_id}", "type": "message", "role": "assistant", "model": body.model,
            "content": blocks, "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(ans.final.usage, len(ans.final.token_ids))}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def stream(front, body: MessagesRequest, req: api.GenerateRequest, handle):
    """Server-sent events in Anthropic's order: message_start, ping, per block start / deltas / stop (a block
    ends when the kind of output changes), message_delta (stop_reason, usage), message_stop."""
    n_prompt = getattr(handle, "prompt_tokens", 0)
    yield _event("message_start", {"message": {
        "id": f"msg_{req.request_id}", "type": "message", "role": "assistant", "model": body.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}}})
    yield _event("ping", {})
    index, open_kind, n_calls = -1, None, 0

    def close():
        return _event("content_block_stop", {"index": index}) if open_kind else ""
    async for kind, x in output.parts(front.engine, req, handle):
        if kind == "error":
            status, err, code = classify(x)
            front.count("Messages", code)
            yield _event("error", {"error": anthropic_body(anthropic_type(x), err["error"]["message"])["error"]})
            return
        if kind == "token":
            continue
        if kind in ("reasoning", "content"):
            block = "thinking" if kind == "reasoning" else "text"
            x = x if block == "text" or _shown(body) else ""
            if open_kind != block:
                yield close()
                index, open_kind = index + 1, block
                start = {"type": "thinking", "thinking": "", "signature": ""} if block == "thinking" else \
                    {"type": "text", "text": ""}
                yield _event("content_block_start", {"index": index, "content_block": start})
            delta = {"type": "thinking_delta", "thinking": x} if block == "thinking" else {"type": "text_delta", "text": x}
            yield _event("content_block_delta", {"index": index, "delta": delta})
        elif kind == "tool_call":
            yield close()
            index, open_kind, n_calls = index + 1, "tool_use", n_calls + 1
            yield _event("content_block_start", {"index": index, "content_block": _tool_block(x, with_input=False)})
            yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                            "partial_json": x.arguments}})
        elif kind == "final":
            if index < 0:                          # an empty answer is one empty text block, as non-streamed
                index, open_kind = 0, "text"
                yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield close()
            finish = "tool_calls" if n_calls and x.finish_reason == "stop" else x.finish_reason
            reason, seq = _stop(finish, x)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                           "usage": _usage(x.usage, len(x.token_ids))})
            yield _event("message_stop", {})
            front.count("Messages", "OK")


def add_routes(app: FastAPI, front) -> None:
    @app.post(PREFIX, response_model=None)
    async def messages(body: MessagesRequest, request: Request):
        front.check_model(body.model)
        req = to_request(body)
        if body.stream:
            handle = await anyio.to_thread.run_sync(front.submit, req)    # errors before the stream: a status
            return output.EventStream(stream(front, body, req, handle), handle)
        ans = await output.answer(front.engine, req, request)
        front.count("Messages", "CANCELLED" if ans.final.finish_reason == "cancelled" else "OK")
        return full_response(body, req, ans)

    @app.post(PREFIX + "/count_tokens", response_model=None)
    async def count_tokens(body: CountTokensRequest):
        front.check_model(body.model)
        tools, _ = _tools(body)
        req = api.GenerateRequest(messages=_messages(body), tools=tools, chat_template_kwargs=_template_kwargs(body))
        ids = await anyio.to_thread.run_sync(front.engine.prompt_ids, req)
        front.count("MessagesCountTokens", "OK")
        return {"input_tokens": len(ids)}

