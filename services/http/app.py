"""The OpenAI-compatible HTTP front (FastAPI): the same engine, queue, limits and metrics as gRPC.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/{id}]
    GET /health                 POST /tokenize         POST /detokenize        (llama.cpp's names)

Streaming is server-sent events as OpenAI sends them (`data: {chunk}` ... `data: [DONE]`). Every byte of
text reaches the client in a delta: the text held back as a possible stop-string prefix is sent as a last
delta before the finish chunk. Errors are OpenAI's body {"error": {"message", "type", "param", "code"}} with
the HTTP status of the problem (the one table, betelgeuse/errors.py), never a traceback; an error after a stream
started is one `data: {"error":..}` event followed by `data: [DONE]`. With [worker] api_keys every path but /health
and /metrics needs a key (Edge, below); the connection limits are services/http/server.py's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from betelgeuse import api
from betelgeuse.errors import BetelgeuseError, InternalError, InvalidRequestError, NotFoundError, RequestTooLargeError
from services.auth import ApiKeys
from services.http import anthropic, output, responses
from services.http import protocol as p
from services.http.errors import MethodNotAllowedError, classify, error_body, error_response
from services.http.output import events

log = logging.getLogger("betelgeuse.http")

MAX_BODY_BYTES = 32 * 1024 * 1024   # a request body larger than this is refused (413) before it is read or parsed
OPEN_PATHS = ("/health", "/metrics")  # answered without an API key (probes, Prometheus); everything else needs one


def _usage(u: api.Usage, n_out: int) -> dict:
    return {"prompt_tokens": u.prompt_n, "completion_tokens": n_out, "total_tokens": u.prompt_n + n_out,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _timings(u: api.Usage) -> dict:
    """llama.cpp's `timings` object plus our expert-tier and disk figures."""
    return {f: getattr(u, f) for f in api.Usage.__dataclass_fields__}


def _stop_reason(f: api.FinalEvent):
    """vLLM's choice.stop_reason: the stop string or token id that fired; None for EOS and the rest."""
    if f.stop_reason == "stop_string":
        return f.stop_string
    if f.stop_reason == "stop_token":
        return f.stop_token_id
    return None


def _tool_call_json(c: api.ToolCall, index: int | None = None) -> dict:
    d = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    if index is not None:
        d["index"] = index
    return d


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage_sse(head: dict, f: api.FinalEvent) -> str:
    """A stream's last chunk with stream_options.include_usage: no choices, the usage and timings of `f`; head: the
    stream's id, object, created and model."""
    return _sse({**head, "choices": [], "usage": _usage(f.usage, len(f.token_ids)), "timings": _timings(f.usage)})


class Front:
    """Routes over one engine. `metrics` (optional) gets betelgeuse_requests_total{method, code}."""

    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        mi = engine.model_info()
        self.model_name = mi.name or "betelgeuse"
        self.created = int(time.time())
        self.tok = getattr(engine, "tokenizer", None)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def count(self, method: str, code: str):
        if self.metrics is not None:
            self.metrics.requests.labels(method=method, code=code).inc()

    def check_model(self, name: str):
        import os
        mi = self.engine.model_info()
        names = {self.model_name, os.path.basename(mi.path), os.path.splitext(os.path.basename(mi.path))[0]}
        if name not in names:
            raise ModelNotFound(name, self.model_name)

    def piece(self, tid: int) -> str:
        return self.tok.id_to_piece(tid) if self.tok is not None else ""

    def token_bytes(self, tid: int) -> list[int]:
        return list(self.tok.token_bytes(tid)) if self.tok is not None else []

    def chat_logprobs(self, ev: api.TokenEvent) -> dict:
        return {"token": self.piece(ev.token_id), "logprob": ev.logprob, "bytes": self.token_bytes(ev.token_id),
                "top_logprobs": [{"token": self.piece(i), "logprob": lp, "bytes": self.token_bytes(i)}
                                 for i, lp in ev.top_logprobs]}

    def submit(self, req: api.GenerateRequest):
        return output.submit(self.engine, req)

    # ---- chat ------------------------------------------------------------------------------------------------
    def chat_full(self, body: p.ChatCompletionRequest, req: api.GenerateRequest, ans: output.Answer) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": ans.content if (ans.content or not ans.calls) else None}
        if ans.reasoning:
            msg["reasoning_content"] = ans.reasoning
        if ans.calls:
            msg["tool_calls"] = [_tool_call_json(c) for c in ans.calls]
        lps = [self.chat_logprobs(ev) for ev in ans.tokens] if req.sampling.logprobs else None
        choice = {"index": 0, "message": msg, "logprobs": {"content": lps} if lps is not None else None,
                  "finish_reason": ans.finish_reason, "stop_reason": _stop_reason(ans.final)}
        return {"id": f"chatcmpl-{req.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": body.model, "choices": [choice], "usage": _usage(ans.final.usage, len(ans.final.token_ids)),
                "timings": _timings(ans.final.usage)}

    async def chat_stream(self, body: p.ChatCompletionRequest, req: api.GenerateRequest, handle):
        cid, created = f"chatcmpl-{req.request_id}", int(time.time())
        n_calls, lp = 0, None

        def chunk(delta: dict, finish=None, logprobs=None, **extra) -> str:
            c = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            c.update(extra)
            return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                         "choices": [c]})

        yield chunk({"role": "assistant", "content": ""})
        async for kind, x in output.parts(self.engine, req, handle):
            if kind in ("final", "error") and lp is not None:
                yield chunk({"content": ""}, logprobs=lp)      # a token whose text is not out yet: its logprobs
                lp = None
            if kind == "error":
                status, err, code = classify(x)
                self.count("ChatCompletions", code)
                yield _sse(err)
                break
            if kind == "token":
                if lp is not None:
                    yield chunk({"content": ""}, logprobs=lp)
                lp = {"content": [self.chat_logprobs(x)]} if req.sampling.logprobs else None
            elif kind in ("content", "reasoning"):
                yield chunk({"content" if kind == "content" else "reasoning_content": x}, logprobs=lp)
                lp = None
            elif kind == "tool_call":
                yield chunk({"tool_calls": [_tool_call_json(x, n_calls)]}, logprobs=lp)
                n_calls, lp = n_calls + 1, None
            else:
                finish = "tool_calls" if x.finish_reason == "stop" and n_calls else x.finish_reason
                yield chunk({}, finish=finish, stop_reason=_stop_reason(x))
                if body.stream_options and body.stream_options.include_usage:
                    yield _usage_sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                      "model": body.model}, x)
                self.count("ChatCompletions", "OK")
        yield "data: [DONE]\n\n"

    # ---- completions -----------------------------------------------------------------------------------------
    def legacy_logprobs(self, evs: list[api.TokenEvent], offset0: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        off = offset0
        for ev in evs:
            out["tokens"].append(self.piece(ev.token_id))
            out["token_logprobs"].append(ev.logprob)
            out["top_logprobs"].append({self.piece(i): lp for i, lp in ev.top_logprobs})
            out["text_offset"].append(off)
            off += len(ev.text)
        return out

    def completion_full(self, body: p.CompletionRequest, req: api.GenerateRequest, ans: output.Answer) -> dict:
        # a text prompt: the whole text is the answer
        final = ans.final
        choice = {"index": 0, "text": ans.content,
                  "logprobs": self.legacy_logprobs(ans.tokens) if req.sampling.logprobs else None,
                  "finish_reason": final.finish_reason, "stop_reason": _stop_reason(final)}
        return {"id": f"cmpl-{req.request_id}", "object": "text_completion", "created": int(time.time()),
                "model": body.model, "choices": [choice], "usage": _usage(final.usage, len(final.token_ids)),
                "timings": _timings(final.usage)}

    async def completion_stream(self, body: p.CompletionRequest, req: api.GenerateRequest, handle):
        cid, created = f"cmpl-{req.request_id}", int(time.time())
        offset = 0

        def chunk(text: str, finish=None, logprobs=None, **extra) -> str:
            c = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            c.update(extra)
            return _sse({"id": cid, "object": "text_completion", "created": created, "model": body.model,
                         "choices": [c]})

        async for ev in events(handle):
            if isinstance(ev, BaseException):
                status, err, code = classify(ev)
                self.count("Completions", code)
                yield _sse(err)
                break
            if isinstance(ev, api.TokenEvent):
                if ev.text or req.sampling.logprobs:
                    lp = self.legacy_logprobs([ev], offset) if req.sampling.logprobs else None
                    yield chunk(ev.text, logprobs=lp)
                offset += len(ev.text)
                continue
            if ev.tail:
                yield chunk(ev.tail)
            yield chunk("", finish=ev.finish_reason, stop_reason=_stop_reason(ev))
            if body.stream_options and body.stream_options.include_usage:
                yield _usage_sse({"id": cid, "object": "text_completion", "created": created, "model": body.model}, ev)
            self.count("Completions", "OK")
        yield "data: [DONE]\n\n"


class ModelNotFound(NotFoundError):
    param, error_code = "model", "model_not_found"

    def __init__(self, name: str, served: str):
        super().__init__(f"the model {name!r} does not exist; this server serves {served!r} (GET /v1/models)")




def _union_tag(x) -> bool:
    """A component pydantic adds to an error's loc for the member of a union it tried ("str", "list[str]",
    "NamedToolChoice", "literal['auto']"): not a field of the request (fields are lower-case names and indexes)."""
    return isinstance(x, str) and ("[" in x or x[:1].isupper() or x in ("str", "int", "float", "bool", "none"))


def _first_param(exc: RequestValidationError) -> tuple[str | None, str]:
    """The first invalid field -> (its dotted name, the message naming it). A field whose value matched none of a
    union's members gets one error per member, the type mismatches first: the member of the value's own kind says
    what is wrong (`stop` as a list of 1000: "at most 16 items", not "should be a valid string"); when every
    member is a type mismatch, the message lists the kinds accepted."""
    errs = exc.errors()
    if not errs:
        return None, "invalid request"

    def field(err) -> list[str]:
        return [str(x) for x in err.get("loc", ()) if x != "body" and not _union_tag(x)]

    def base(err) -> tuple:                  # the loc up to its first union member
        loc = tuple(x for x in err.get("loc", ()) if x != "body")
        i = next((k for k, x in enumerate(loc) if _union_tag(x)), len(loc))
        return loc[:i]

    e = errs[0]
    members = [x for x in errs if base(x) == base(e)] if any(map(_union_tag, e.get("loc", ()))) else [e]
    kind = [x for x in members if not x.get("type", "").endswith("_type")]
    msg = e.get("msg", "invalid value")
    if kind:
        e, msg = kind[0], kind[0].get("msg", "invalid value")
    elif len(members) > 1:                   # "Input should be a valid string or a valid list"
        msg = " or ".join([members[0]["msg"]] + [x["msg"].removeprefix("Input should be ") for x in members[1:]])
    param = ".".join(field(e)) or None
    if e.get("type") == "json_invalid":
        return None, "the request body is not valid JSON"
    if e.get("type") == "missing":
        return param, f"missing required parameter: {param}"
    if e.get("type") == "extra_forbidden":
        return param, f"unknown parameter: {param} (not supported by this server)"
    return param, f"{param}: {msg}" if param else msg


class Edge:
    """Pure ASGI middleware around the routes (inside Starlette's ServerErrorMiddleware, outside the exception
    handlers): API keys on every path but OPEN_PATHS, the body-size limit from Content-Length (before a byte of the
    body is read; a chunked body: counted as it is read, _bounded_body), and a bug -> one log line and a 500 in the
    path's shape. Catching bugs here, not in an `Exception` handler, keeps ServerErrorMiddleware from re-raising them
    to uvicorn, which would log a second, multi-line traceback for the same event."""

    def __init__(self, app, front: "Front", keys: ApiKeys):
        self.app, self.front, self.keys = app, front, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        try:
            if path not in OPEN_PATHS:
                self.keys.check(scope["headers"])
            n = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), None)
            if n is not None and (not n.isdigit() or int(n) > MAX_BODY_BYTES):
                raise RequestTooLargeError(f"the request body is larger than {MAX_BODY_BYTES} bytes")
            if n is None and any(k == b"transfer-encoding" for k, _ in scope["headers"]):
                receive = await _bounded_body(receive)
                if receive is None:                  # the client went away while sending it
                    return
        except BetelgeuseError as e:
            self.front.count(_method(path), e.grpc_code)
            return await error_response(path, e)(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracked)
        except RecursionError:                       # JSON nested past the parser's limit: the body's fault
            e = InvalidRequestError("the request body is nested too deeply")
            self.front.count(_method(path), e.grpc_code)
            if not started:
                await error_response(path, e)(scope, receive, send)
        except Exception as e:                       # noqa: BLE001 (a bug: logged once, on one line)
            log.error("internal error in %s %s", scope.get("method"), path, exc_info=e)
            self.front.count(_method(path), InternalError.grpc_code)
            if not started:
                await error_response(path, e)(scope, receive, send)


async def _bounded_body(receive):
    """A chunked body (no Content-Length to refuse it by) read here, counted as it comes: past MAX_BODY_BYTES it is
    refused (RequestTooLargeError) before more is read, instead of the whole of it landing in the worker's memory
    (the GPU worker's: a client streaming gigabytes would get it killed for memory). -> a `receive` that gives the
    routes the body read, then the connection's own messages (a disconnect); None: the client left meanwhile."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        parts.append(msg.get("body", b""))
        size += len(parts[-1])
        if size > MAX_BODY_BYTES:
            raise RequestTooLargeError(f"the request body is larger than {MAX_BODY_BYTES} bytes")
        if not msg.get("more_body", False):
            break
    pending = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


def build_app(engine, metrics=None, api_keys: list[str] | None = None) -> FastAPI:
    """The routes over `engine`; with `api_keys`, every path but /health and /metrics needs one of them."""
    front = Front(engine, metrics)
    app = FastAPI(title="Betelgeuse OpenAI-compatible API", version="1",
                  description="OpenAI-compatible chat/completions over the Betelgeuse engine.")
    app.state.front = front
    app.add_middleware(Edge, front=front, keys=ApiKeys(api_keys))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        param, msg = _first_param(exc)
        front.count(_method(request.url.path), "INVALID_ARGUMENT")
        return error_response(request.url.path, p.UnsupportedParam(param, msg))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            e = NotFoundError(f"no such endpoint: {request.method} {request.url.path}")
        elif exc.status_code == 405:
            e = MethodNotAllowedError(f"method {request.method} is not allowed on {request.url.path}")
        else:
            e = InvalidRequestError(msg)
            e.http_status = exc.status_code
        r = error_response(request.url.path, e)
        r.headers.update(getattr(exc, "headers", None) or {})
        return r

    @app.exception_handler(BetelgeuseError)        # ours (the table says its status): no re-raise, no traceback
    async def _ours(request: Request, exc: BetelgeuseError):
        front.count(_method(request.url.path), exc.grpc_code)
        return error_response(request.url.path, exc)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        front.check_model(body.model)
        req = p.chat_request(body)
        if body.stream:
            handle = await anyio.to_thread.run_sync(front.submit, req)    # errors before the stream: a status
            return output.EventStream(front.chat_stream(body, req, handle), handle)
        ans = await output.answer(engine, req, request)
        front.count("ChatCompletions", "CANCELLED" if ans.final.finish_reason == "cancelled" else "OK")
        return front.chat_full(body, req, ans)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request):
        front.check_model(body.model)
        req = p.completion_request(body)
        if body.stream:
            handle = await anyio.to_thread.run_sync(front.submit, req)
            return output.EventStream(front.completion_stream(body, req, handle), handle)
        ans = await output.answer(engine, req, request)
        front.count("Completions", "CANCELLED" if ans.final.finish_reason == "cancelled" else "OK")
        return front.completion_full(body, req, ans)

    def model_card() -> dict:
        mi = engine.model_info()
        # OpenAI's model object, with Anthropic's fields too (its client lists models from the same path)
        return {"id": front.model_name, "object": "model", "created": front.created, "owned_by": "betelgeuse",
                "type": "model", "display_name": front.model_name,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(front.created)),
                "max_model_len": mi.context_length,
                "meta": {"arch": mi.arch, "quant": mi.quant, "n_layer": mi.n_layer, "n_expert": mi.n_expert,
                         "n_expert_used": mi.n_expert_used, "n_vocab": mi.n_vocab, "routing": mi.routing,
                         "prefill_chunk": mi.prefill_chunk, "plan": mi.plan}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        front.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health():
        if engine.is_ready():
            return {"status": "ok"}
        return JSONResponse(error_body("not ready: loading, or the expert store is unavailable",
                                       "service_unavailable_error"), status_code=503)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest):
        ids = await anyio.to_thread.run_sync(engine.tokenize, body.content, body.add_special, body.parse_special)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": front.piece(i)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest):
        return {"content": await anyio.to_thread.run_sync(engine.detokenize, body.tokens)}

    anthropic.add_routes(app, front)
    responses.add_routes(app, front)

    if metrics is not None:
        @app.get("/metrics", include_in_schema=False)
        async def prometheus():                   # the worker's registry, also on the API port
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
            from starlette.responses import Response
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app)
    return app


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


STREAMING = ("/v1/chat/completions", "/v1/completions", anthropic.PREFIX, "/v1/responses")


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, with what this server really answers: 400 (not 422) with OpenAI's error body,
    the other error statuses, and SSE for the streaming endpoints."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    err = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    anth = {"description": "error (Anthropic's shape)",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
    doc.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    doc["components"]["schemas"]["AnthropicError"] = anthropic.ERROR_SCHEMA
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            rs = op.setdefault("responses", {})
            rs.pop("422", None)
            codes = ["500"]
            if method == "post" or "{" in path:
                codes.append("400")
            if path.startswith("/v1/") and (method == "post" or "{" in path):
                codes.append("404")
            if path in STREAMING:
                codes += ["429", "503"]
                rs["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
            if path == "/health":
                codes.append("503")
            for c in codes:
                rs[c] = anth if path.startswith(anthropic.PREFIX) else err
    for name in ("HTTPValidationError", "ValidationError"):
        doc["components"]["schemas"].pop(name, None)
    app.openapi_schema = doc
    return doc


METHODS = {"/v1/chat/completions": "ChatCompletions", "/v1/completions": "Completions", "/tokenize": "HttpTokenize",
           "/detokenize": "HttpDetokenize", "/v1/messages": "Messages", "/v1/messages/count_tokens": "MessagesCountTokens",
           "/v1/responses": "Responses"}


def _method(path: str) -> str:
    """A bounded label set for betelgeuse_requests_total (a fuzzer's random paths must not grow it)."""
    return METHODS.get(path, "Responses" if path.startswith("/v1/responses/") else "HttpOther")
