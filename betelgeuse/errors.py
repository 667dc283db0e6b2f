"""Exceptions a user can cause. Each carries a one-line message that names the problem.

The CLI prints `betelgeuse: error: <message>` and exits non-zero. Each class also carries, once, what it is on
every edge (the one error table; the gRPC interceptor, the OpenAI front and the Anthropic front all read it):

    grpc_code       the gRPC status code's name (services/ maps it to grpc.StatusCode; no grpc import here)
    http_status     the HTTP status of the OpenAI-compatible front (503 answers carry Retry-After: retry_after_s)
    openai_type     OpenAI's error `type`
    anthropic_type  Anthropic's error `type` (under /v1/messages)

A subclass inherits its parent's row unless it sets its own. Anything that is not a BetelgeuseError is a bug: it
keeps its traceback (in the log, on one line) and reaches clients as INTERNAL / 500.
"""


class BetelgeuseError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""

    exit_code = 2
    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    retry_after_s: int | None = None       # seconds a client should wait before retrying (HTTP Retry-After)


class ModelFormatError(BetelgeuseError):
    """The file is missing, truncated, not GGUF, or holds something we cannot run."""

    grpc_code, http_status, openai_type, anthropic_type = "FAILED_PRECONDITION", 500, "server_error", "api_error"


class UnsupportedError(ModelFormatError):
    """A well-formed file that uses an architecture, quant type or tokenizer we do not support."""


class InvalidRequestError(BetelgeuseError):
    """Bad request parameters: token ids out of range, over-long prompt, bad sampling values."""


class RequestTooLargeError(InvalidRequestError):
    """A request body over the size limit, refused before it is read."""

    http_status, anthropic_type = 413, "request_too_large"


class UnauthenticatedError(BetelgeuseError):
    """No API key, or a wrong one, where keys are configured."""

    grpc_code, http_status, openai_type, anthropic_type = ("UNAUTHENTICATED", 401, "authentication_error",
                                                           "authentication_error")


class NotFoundError(BetelgeuseError):
    """A named thing the server does not have (a model id, a stored response)."""

    grpc_code, http_status, openai_type, anthropic_type = "NOT_FOUND", 404, "invalid_request_error", "not_found_error"


class BudgetError(BetelgeuseError):
    """A slot/memory configuration that cannot fit the cgroup or VRAM budget (names the numbers)."""

    grpc_code, http_status, openai_type, anthropic_type = "FAILED_PRECONDITION", 500, "server_error", "api_error"


class QueueFullError(BetelgeuseError):
    """The bounded request queue is full."""

    grpc_code, http_status, openai_type, anthropic_type = "RESOURCE_EXHAUSTED", 429, "rate_limit_error", \
        "rate_limit_error"
    retry_after_s = 1


class StoreUnavailableError(BetelgeuseError):
    """The expert-store process cannot be reached (not started, crashed, restarting), or refuses work (its model
    file changed under it)."""

    grpc_code, http_status, openai_type, anthropic_type = "UNAVAILABLE", 503, "service_unavailable_error", \
        "overloaded_error"
    retry_after_s = 1


class CancelledError(BetelgeuseError):
    """The request was cancelled or its deadline passed; the engine stopped working on it."""

    grpc_code, http_status, openai_type, anthropic_type = "CANCELLED", 499, "cancelled", "api_error"


class InternalError(BetelgeuseError):
    """A failure that is not the request's fault (a NaN in the model's output, a bug caught at a sequence's
    boundary). It fails that request alone with INTERNAL; the engine keeps serving."""

    grpc_code, http_status, openai_type, anthropic_type = "INTERNAL", 500, "server_error", "api_error"


class ShuttingDownError(BetelgeuseError):
    """The server is draining before it stops: new work is refused (UNAVAILABLE), running work finishes."""

    grpc_code, http_status, openai_type, anthropic_type = "UNAVAILABLE", 503, "service_unavailable_error", \
        "overloaded_error"
    retry_after_s = 1


class StoreBusyError(BetelgeuseError):
    """The expert store already serves another live worker, or another store holds the runtime directory."""

    grpc_code, http_status, openai_type, anthropic_type = "FAILED_PRECONDITION", 500, "server_error", "api_error"


def error_classes() -> list[type[BetelgeuseError]]:
    """BetelgeuseError and every subclass defined so far (depth first): what the error-table test walks."""
    out, todo = [], [BetelgeuseError]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(reversed(c.__subclasses__()))
    return out
