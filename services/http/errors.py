"""How the HTTP fronts report an error, from the one error table (betelgeuse/errors.py: each class's HTTP status,
OpenAI type, Anthropic type, gRPC code and Retry-After): OpenAI's body {"error": {"message", "type", "param",
"code"}}, or Anthropic's {"type": "error", "error": {"type", "message"}} under /v1/messages."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from betelgeuse.errors import BetelgeuseError, InternalError, InvalidRequestError

ANTHROPIC_PREFIX = "/v1/messages"         # the paths whose errors are spelled Anthropic's way


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def anthropic_body(kind: str, message: str) -> dict:
    """Anthropic's error shape; `kind` is the error class's anthropic_type."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def classify(e: BaseException) -> tuple[int, dict, str]:
    """(HTTP status, OpenAI error body, gRPC code name for betelgeuse_requests_total) of an exception. A bug is a 500
    whose message points at the log, never its text."""
    if isinstance(e, BetelgeuseError):
        return e.http_status, error_body(str(e), e.openai_type, getattr(e, "param", None),
                                         getattr(e, "error_code", None)), e.grpc_code
    return InternalError.http_status, error_body("internal error; see the worker log", InternalError.openai_type), \
        InternalError.grpc_code


def anthropic_type(e: BaseException) -> str:
    return e.anthropic_type if isinstance(e, BetelgeuseError) else InternalError.anthropic_type


def retry_headers(e: BaseException) -> dict | None:
    """Retry-After for the errors a client should retry (UNAVAILABLE: 503, RESOURCE_EXHAUSTED: 429)."""
    s = getattr(e, "retry_after_s", None)
    return {"Retry-After": str(s)} if s else None


def error_response(path: str, e: BaseException) -> JSONResponse:
    """An error in the shape of the API the path belongs to."""
    status, body, _ = classify(e)
    if path.startswith(ANTHROPIC_PREFIX):
        body = anthropic_body(anthropic_type(e), body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=retry_headers(e))


class MethodNotAllowedError(InvalidRequestError):
    """A known path asked with the wrong HTTP method."""

    http_status = 405
