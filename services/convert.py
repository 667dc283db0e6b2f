"""from_pb / to_pb: the only place protobuf meets betelgeuse's dataclasses (TGI's models/types.py)."""

from __future__ import annotations

from betelgeuse.errors import InvalidRequestError
from betelgeuse.worker import api
from services.pb.betelgeuse.v1 import inference_pb2 as pb

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "cancelled": pb.FINISH_REASON_CANCELLED}


def request_from_pb(m: pb.GenerateRequest) -> api.GenerateRequest:
    which = m.WhichOneof("prompt")
    if which is None:
        raise InvalidRequestError("the request has no prompt: set prompt_text, prompt_ids or messages")
    s = m.sampling
    sampling = api.SamplingParams(
        temperature=float(s.temperature), top_k=int(s.top_k),
        top_p=float(s.top_p) if s.HasField("top_p") else 1.0,
        seed=int(s.seed) if s.HasField("seed") else None)
    return api.GenerateRequest(
        prompt_text=m.prompt_text if which == "prompt_text" else None,
        prompt_ids=list(m.prompt_ids.ids) if which == "prompt_ids" else None,
        messages=[{"role": x.role, "content": x.content} for x in m.messages.messages] if which == "messages" else None,
        sampling=sampling,
        max_tokens=int(m.max_tokens) if m.HasField("max_tokens") else 64,
        stop=list(m.stop), stop_token_ids=list(m.stop_token_ids), ignore_eos=m.ignore_eos,
        request_id=m.request_id)


def usage_to_pb(u: api.Usage) -> pb.Usage:
    return pb.Usage(**{f: getattr(u, f) for f in api.Usage.__dataclass_fields__})


def event_to_pb(ev: api.Event, request_id: str) -> pb.GenerateResponse:
    if isinstance(ev, api.TokenEvent):
        return pb.GenerateResponse(request_id=request_id,
                                   token=pb.TokenEvent(token_id=ev.token_id, text=ev.text, index=ev.index))
    return pb.GenerateResponse(request_id=request_id, final=pb.FinalEvent(
        finish_reason=FINISH[ev.finish_reason], text=ev.text, token_ids=ev.token_ids,
        usage=usage_to_pb(ev.usage), tail=ev.tail))


def model_info_to_pb(mi: api.ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**{f: getattr(mi, f) for f in api.ModelInfo.__dataclass_fields__})


def server_info_to_pb(si: api.ServerInfo) -> pb.ServerInfo:
    d = {f: getattr(si, f) for f in api.ServerInfo.__dataclass_fields__}
    return pb.ServerInfo(**d)
