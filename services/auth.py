"""API keys for every listener (gRPC and HTTP read the same [worker] api_keys / api_key_file).

A key is presented as `authorization: Bearer KEY` or `x-api-key: KEY` (gRPC metadata or HTTP headers; the OpenAI
clients send the first, Anthropic's the second). Every configured key is compared in constant time
(hmac.compare_digest), with no early exit, so the time taken says nothing about how much of a key matched.
"""

from __future__ import annotations

import hmac

from betelgeuse.errors import BetelgeuseError, UnauthenticatedError

MISSING = ("missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")


def load_api_keys(keys: list[str], key_file: str = "") -> list[str]:
    """The configured keys plus one per non-empty, non-# line of key_file."""
    out = [k for k in keys if k]
    if key_file:
        try:
            with open(key_file) as f:
                out += [l.strip() for l in f if l.strip() and not l.lstrip().startswith("#")]
        except OSError as e:
            raise BetelgeuseError(f"api_key_file {key_file}: {e.strerror or e}") from None
        if not out:
            raise BetelgeuseError(f"api_key_file {key_file} holds no key")
    return out


def presented_key(pairs) -> str | None:
    """The key in (name, value) pairs (gRPC metadata, or HTTP headers as str or bytes; names lower-case)."""
    for k, v in pairs or ():
        if isinstance(k, bytes):
            k, v = k.decode("latin-1"), v.decode("latin-1")
        if k == "authorization" and isinstance(v, str) and v[:7].lower() == "bearer ":
            return v[7:].strip()
        if k == "x-api-key" and isinstance(v, str):
            return v.strip()
    return None


class ApiKeys:
    """The configured keys; `check(pairs)` raises UnauthenticatedError unless one of them is presented."""

    __slots__ = ("keys",)

    def __init__(self, keys: list[str] | None):
        self.keys = [k.encode() for k in (keys or [])]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def authorized(self, pairs) -> bool:
        if not self.keys:
            return True
        got = presented_key(pairs)
        if got is None:
            return False
        got_b = got.encode("utf-8", "surrogateescape")
        ok = False
        for k in self.keys:                     # every key compared, no early exit
            ok |= hmac.compare_digest(got_b, k)
        return ok

    def check(self, pairs) -> None:
        if not self.authorized(pairs):
            raise UnauthenticatedError(MISSING)
