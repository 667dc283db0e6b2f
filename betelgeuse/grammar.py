"""Constrained decoding with llguidance (PyPI `llguidance`: a Rust wheel with no dependencies, built from our
HF `tokenizers` JSON): JSON objects, JSON schemas, Lark grammars, regexes, and forced tool calls.

    c = Grammars(tokenizer).constraint(api.Grammar("json_schema", schema))   # InvalidRequestError if bad
    allowed = c.allowed()          # bool [n_vocab]: tokens the grammar admits next (EOS once it may end)
    c.accept(token)                # after sampling
    c.done                         # the grammar admits nothing more: the output is complete

Chosen over xgrammar, whose wheel requires transformers and triton at run time. Output is valid by
construction; it may still end by `length` before the grammar completes (max_tokens / the context).
JSON is generated compact (no free whitespace), so that a random-weight model cannot wander in blanks.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from betelgeuse.errors import InvalidRequestError
from betelgeuse.worker.api import Grammar

JSON_OPTIONS = {"whitespace_flexible": False}


def _schema(schema: Any) -> dict:
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be an object")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def tool_call_grammar(tools: list[dict], name: str | None) -> Grammar:
    """A Lark grammar for Hermes tool calls: exactly one call of `name`, or (name None: tool_choice "required")
    one or more calls of any of `tools`, each `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
    funcs = {}
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            funcs[f["name"]] = f.get("parameters") or {"type": "object"}
    if name is not None:
        if name not in funcs:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools")
        funcs = {name: funcs[name]}
    if not funcs:
        raise InvalidRequestError("tool_choice needs at least one function in tools")
    rules = []
    for i, (fname, params) in enumerate(funcs.items()):
        obj = {"type": "object", "properties": {"name": {"const": fname}, "arguments": params},
               "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"call{i}: \"<tool_call>\\n\" %json {json.dumps(_schema(obj))} \"\\n</tool_call>\"")
    alts = " | ".join(f"call{i}" for i in range(len(funcs)))
    start = "start: call" if name is not None else 'start: call ("\\n" call)*'
    return Grammar("lark", "\n".join([start, f"call: {alts}", *rules]))


class Constraint:
    """One sequence's grammar state (an llguidance matcher)."""

    __slots__ = ("matcher", "n_vocab", "never")

    def __init__(self, matcher, n_vocab: int, never: torch.Tensor):
        self.matcher, self.n_vocab, self.never = matcher, n_vocab, never

    def allowed(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.n_vocab].astype(bool))
        return mask & ~self.never

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            # only possible if a token outside the mask was forced in (a bug): say so
            raise InvalidRequestError(f"constrained output rejected token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


class Grammars:
    """The llguidance tokenizer of one model (built once), and constraints from api.Grammar values."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._ll = None
        self._lock = threading.Lock()
        # tokens the grammar must never pick: UNUSED padding pieces are ordinary BPE entries to llguidance
        # but decode to nothing here, so text and grammar would disagree
        from betelgeuse.tokenizer import UNUSED
        self._never = torch.tensor([t == UNUSED for t in tokenizer._types], dtype=torch.bool)

    def _lltok(self):
        with self._lock:
            if self._ll is None:
                import llguidance
                self._ll = llguidance.LLTokenizer(self.tok._tok.to_str(), n_vocab=self.tok.n_vocab,
                                                  eos_token=sorted(self.tok.eos_ids))
            return self._ll

    def grammar_text(self, g: Grammar) -> str:
        from llguidance import LLMatcher
        try:
            if g.kind == "json_object":
                return LLMatcher.grammar_from_json_schema(_schema({"type": "object"}))
            if g.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(_schema(g.value))
            if g.kind == "lark":
                return LLMatcher.grammar_from_lark(str(g.value))
            if g.kind == "regex":
                return LLMatcher.grammar_from_regex(str(g.value))
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"{g.kind}: {e}") from None
        raise InvalidRequestError(f"unknown grammar kind {g.kind!r} (json_object, json_schema, lark, regex)")

    def constraint(self, g: Grammar) -> Constraint:
        from llguidance import LLMatcher
        text = self.grammar_text(g)
        ll = self._lltok()
        err = LLMatcher.validate_grammar(text, ll)
        if err and not err.startswith("WARNING"):
            raise InvalidRequestError(f"invalid {g.kind.replace('_', ' ')}: {err.strip().splitlines()[0][:300]}")
        m = LLMatcher(ll, text, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"invalid {g.kind.replace('_', ' ')}: {m.get_error()[:300]}")
        return Constraint(m, self.tok.n_vocab, self._never)
