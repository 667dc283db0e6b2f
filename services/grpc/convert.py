"""from_pb / to_pb: the only place protobuf meets betelgeuse's dataclasses (TGI's models/types.py)."""

from __future__ import annotations

import json

from betelgeuse import api
from betelgeuse.errors import InvalidRequestError
from services.pb.betelgeuse.v1 import inference_pb2 as pb

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "cancelled": pb.FINISH_REASON_CANCELLED,
          "tool_calls": pb.FINISH_REASON_TOOL_CALLS}


def _json(text: str, field: str, kind: type):
    """A JSON-text field ("" = unset) -> the value, checked to be a `kind`."""
    if not text:
        return None
    try:
        v = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"{field} is not valid JSON: {e}") from None
    if not isinstance(v, kind):
        raise InvalidRequestError(f"{field} must be a JSON {'array' if kind is list else 'object'}")
    return v


def _message(x: pb.ChatMessage) -> dict:
    m = {"role": x.role, "content": x.content}
    if x.tool_calls:
        m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in x.tool_calls]
    if x.tool_call_id:
        m["tool_call_id"] = x.tool_call_id
    if x.name:
        m["name"] = x.name
    return m


def request_from_pb(m: pb.GenerateRequest) -> api.GenerateRequest:
    which = m.WhichOneof("prompt")
    if which is None:
        raise InvalidRequestError("the request has no prompt: set prompt_text, prompt_ids or messages")
    s = m.sampling
    sampling = api.SamplingParams(
        temperature=float(s.temperature), top_k=int(s.top_k),
        top_p=float(s.top_p) if s.HasField("top_p") else 1.0,
        seed=int(s.seed) if s.HasField("seed") else None,
        min_p=float(s.min_p), presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty),
        repetition_penalty=float(s.repetition_penalty) if s.HasField("repetition_penalty") else 1.0,
        logprobs=s.logprobs, top_logprobs=int(s.top_logprobs))
    choice = m.tool_choice or None
    if choice is not None and choice.lstrip().startswith("{"):
        choice = _json(choice, "tool_choice", dict)
    grammar = None
    if m.HasField("grammar"):
        g = m.grammar
        value = _json(g.value, "grammar.value", dict) if g.kind == "json_schema" else g.value
        grammar = api.Grammar(kind=g.kind, value=value)
    return api.GenerateRequest(
        prompt_text=m.prompt_text if which == "prompt_text" else None,
        prompt_ids=list(m.prompt_ids.ids) if which == "prompt_ids" else None,
        messages=[_message(x) for x in m.messages.messages] if which == "messages" else None,
        sampling=sampling,
        max_tokens=int(m.max_tokens) if m.HasField("max_tokens") else None,
        stop=list(m.stop), stop_token_ids=list(m.stop_token_ids), ignore_eos=m.ignore_eos,
        request_id=m.request_id, parse_special=m.parse_special,
        tools=_json(m.tools, "tools", list), tool_choice=choice,
        chat_template_kwargs=_json(m.chat_template_kwargs, "chat_template_kwargs", dict) or {},
        grammar=grammar, cache_salt=m.cache_salt, fit_context=m.fit_context)


def usage_to_pb(u: api.Usage) -> pb.Usage:
    return pb.Usage(**{f: getattr(u, f) for f in api.Usage.__dataclass_fields__})


def tool_call_to_pb(c: api.ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)


def event_to_pb(ev: api.Event, request_id: str) -> pb.GenerateResponse:
    if isinstance(ev, api.TokenEvent):
        t = pb.TokenEvent(token_id=ev.token_id, text=ev.text, index=ev.index,
                          top_logprobs=[pb.TopLogprob(token_id=i, logprob=lp) for i, lp in ev.top_logprobs])
        if ev.logprob is not None:
            t.logprob = ev.logprob
        return pb.GenerateResponse(request_id=request_id, token=t)
    f = pb.FinalEvent(finish_reason=FINISH[ev.finish_reason], text=ev.text, token_ids=ev.token_ids,
                      usage=usage_to_pb(ev.usage), tail=ev.tail, stop_reason=ev.stop_reason,
                      stop_string=ev.stop_string, tool_calls=[tool_call_to_pb(c) for c in ev.tool_calls])
    if ev.stop_token_id is not None:
        f.stop_token_id = ev.stop_token_id
    return pb.GenerateResponse(request_id=request_id, final=f)


def model_info_to_pb(mi: api.ModelInfo) -> pb.ModelInfo:
    d = {f: getattr(mi, f) for f in api.ModelInfo.__dataclass_fields__}
    plan = d.pop("plan")
    out = pb.ModelInfo(**d)
    if plan is not None:
        out.plan.CopyFrom(pb.SlotPlan(**{k: v for k, v in plan.items() if v is not None}))
    return out


def server_info_to_pb(si: api.ServerInfo) -> pb.ServerInfo:
    d = {f: getattr(si, f) for f in api.ServerInfo.__dataclass_fields__}
    return pb.ServerInfo(**d)
