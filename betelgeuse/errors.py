"""Exceptions a user can cause. Each carries a one-line message that names the problem.

The CLI prints `betelgeuse: error: <message>` and exits non-zero; the gRPC interceptor in
`services/` maps each class to a status code. Anything that is not a BetelgeuseError is a bug
and keeps its traceback.
"""


class BetelgeuseError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""

    exit_code = 2


class ModelFormatError(BetelgeuseError):
    """The file is missing, truncated, not GGUF, or holds something we cannot run."""


class UnsupportedError(ModelFormatError):
    """A well-formed file that uses an architecture, quant type or tokenizer we do not support."""


class InvalidRequestError(BetelgeuseError):
    """Bad request parameters: token ids out of range, over-long prompt, bad sampling values."""


class BudgetError(BetelgeuseError):
    """A slot/memory configuration that cannot fit the cgroup or VRAM budget (names the numbers)."""


class QueueFullError(BetelgeuseError):
    """The bounded request queue is full."""


class StoreUnavailableError(BetelgeuseError):
    """The expert-store process cannot be reached (not started, crashed, restarting)."""


class CancelledError(BetelgeuseError):
    """The request was cancelled or its deadline passed; the engine stopped working on it."""


class InternalError(BetelgeuseError):
    """A failure that is not the request's fault (a NaN in the model's output, a bug caught at a sequence's
    boundary). It fails that request alone with INTERNAL; the engine keeps serving."""


class ShuttingDownError(BetelgeuseError):
    """The server is draining before it stops: new work is refused (UNAVAILABLE), running work finishes."""


class StoreBusyError(BetelgeuseError):
    """The expert store already serves another live worker, or another store holds the runtime directory."""
