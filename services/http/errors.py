"""How the HTTP fronts report an error: OpenAI's body {"error": {"message", "type", "param", "code"}} and the HTTP
status of the problem (Anthropic's front re-spells the body, services/http/anthropic.py)."""

from __future__ import annotations

from betelgeuse.errors import (BetelgeuseError, CancelledError, InvalidRequestError, ModelFormatError,
                               QueueFullError, StoreUnavailableError)

# error class -> (HTTP status, OpenAI error type, gRPC code name for betelgeuse_requests_total)
ERRORS = [
    (InvalidRequestError, 400, "invalid_request_error", "INVALID_ARGUMENT"),
    (QueueFullError, 429, "rate_limit_error", "RESOURCE_EXHAUSTED"),
    (StoreUnavailableError, 503, "service_unavailable_error", "UNAVAILABLE"),
    (CancelledError, 499, "cancelled", "CANCELLED"),
    (ModelFormatError, 500, "server_error", "FAILED_PRECONDITION"),
]
STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def classify(e: BaseException) -> tuple[int, dict, str]:
    """(HTTP status, OpenAI error body, gRPC-style code name) of an exception."""
    for cls, status, type_, code in ERRORS:
        if isinstance(e, cls):
            return status, error_body(str(e), type_, getattr(e, "param", None), getattr(e, "error_code", None)), code
    if isinstance(e, BetelgeuseError):
        return 400, error_body(str(e), "invalid_request_error", getattr(e, "param", None)), "INVALID_ARGUMENT"
    return 500, error_body("internal error; see the worker log", "server_error"), "INTERNAL"
