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

from betelgeuse.api import Grammar
from betelgeuse.errors import InvalidRequestError

JSON_OPTIONS = {"whitespace_flexible": False}


def _schema(schema: Any) -> dict:
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be an object")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def _functions(tools: list[dict], name: str | None) -> dict[str, dict]:
    """name -> parameters schema of the functions a forced call may use (one, or all for "required")."""
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
    return funcs


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _hermes_rules(funcs: dict[str, dict], one: bool) -> list[str]:
    """Each call `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; several separated by "\\n"."""
    rules = []
    for i, (fname, params) in enumerate(funcs.items()):
        obj = {"type": "object", "properties": {"name": {"const": fname}, "arguments": params},
               "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"call{i}: \"<tool_call>\\n\" %json {json.dumps(_schema(obj))} \"\\n</tool_call>\"")
    alts = " | ".join(f"call{i}" for i in range(len(funcs)))
    return ["body: call" if one else 'body: call ("\\n" call)*', f"call: {alts}", *rules]


def _dsml_rules(funcs: dict[str, dict], one: bool) -> list[str]:
    """One `<｜DSML｜tool_calls>` block (as DeepSeek-V4's template writes it after the content) holding one invoke,
    or ("required") one or more; each parameter in the schema's order, required ones always, string-typed ones as
    raw text (string="true", enums as their values), the others as JSON (string="false")."""
    from betelgeuse.toolcalls import DSML
    p_end = _lit(f"</{DSML}parameter>\n")
    rules = []
    for i, (fname, params) in enumerate(funcs.items()):
        params = params if isinstance(params, dict) else {}
        required = set(params.get("required") or [])
        parts = []
        for k, (key, sch) in enumerate((params.get("properties") or {}).items()):
            sch = sch if isinstance(sch, dict) else {}
            rule = f"p{i}_{k}"
            if sch.get("type") == "string":
                head = _lit(f'<{DSML}parameter name="{key}" string="true">')
                if isinstance(sch.get("enum"), list):
                    rules.append(f"{rule}: {head} ({' | '.join(_lit(str(v)) for v in sch['enum'])}) {p_end}")
                else:           # raw text up to the close tag (lazy), at most maxLength characters when given
                    n = sch.get("maxLength")
                    rx = f"/(?s:.{{0,{int(n)}}})/" if isinstance(n, int) else "/(?s:.*)/"
                    rules += [f"{rule}: {head} s{i}_{k}", f"s{i}_{k}[suffix={p_end}]: {rx}"]
            else:
                head = _lit(f'<{DSML}parameter name="{key}" string="false">')
                rules.append(f"{rule}: {head} %json {json.dumps(_schema(sch))} {p_end}")
            parts.append(rule if key in required else rule + "?")
        seq = " ".join(parts)
        # an invoke without arguments is written with one empty line
        rules.append(f"args{i}: {seq}" if required else f'args{i}: "\\n"' + (f" | {seq}" if parts else ""))
        invoke_open, invoke_close = _lit(f'<{DSML}invoke name="{fname}">\n'), _lit(f"</{DSML}invoke>\n")
        rules.append(f"call{i}: {invoke_open} args{i} {invoke_close}")
    alts = " | ".join(f"call{i}" for i in range(len(funcs)))
    block_open, block_close = _lit(f"\n\n<{DSML}tool_calls>\n"), _lit(f"</{DSML}tool_calls>")
    return [f"body: {block_open} {'call' if one else 'call+'} {block_close}", f"call: {alts}", *rules]


def tool_call_grammar(tools: list[dict], name: str | None, dialect=None, reasoning: bool = False) -> Grammar:
    """A Lark grammar for forced tool calls in the dialect's own markup (betelgeuse.reasoning): exactly one call of
    `name`, or (name None: tool_choice "required") one or more calls of any of `tools`. `reasoning`: the prompt
    left a think block open, which the output closes first (any text up to the close tag)."""
    from betelgeuse.reasoning import QWEN3
    d = dialect or QWEN3
    funcs = _functions(tools, name)
    rules = (_dsml_rules if d.tools.name == "deepseek_v4" else _hermes_rules)(funcs, name is not None)
    return Grammar("lark", "\n".join([*_start(d, reasoning), *rules]))


def _start(dialect, reasoning: bool) -> list[str]:
    """`start: body`, or the reasoning first: any text up to the dialect's close tag, then its separator."""
    if not reasoning or dialect.think_close is None:
        return ["start: body"]
    return [f"start: think {_lit(dialect.think_sep)} body" if dialect.think_sep else "start: think body",
            f"think[suffix={_lit(dialect.think_close)}]: /(?s:.*)/"]


def after_reasoning(g: Grammar, dialect, reasoning: bool) -> Grammar:
    """A response_format grammar (JSON) applied after an open think block closes (as vLLM applies structured output
    after the reasoning end); lark and regex grammars govern the whole output as given."""
    if not reasoning or dialect.think_close is None or g.kind not in ("json_object", "json_schema"):
        return g
    schema = _schema({"type": "object"} if g.kind == "json_object" else g.value)
    return Grammar("lark", "\n".join([*_start(dialect, True), f"body: %json {json.dumps(schema)}"]))


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
            # a token the mask allowed is refused when the parser hits one of its limits on this grammar (a
            # self-referencing required property: "Too many items"); else a token outside the mask was forced in
            # (a bug). The error's first line says which; the rest is the parser's state and the whole grammar
            # (kilobytes), for its log, not for the client
            why = (self.matcher.get_error().split("\n<state>", 1)[0].strip().splitlines() or ["no reason"])[0][:300]
            if "limit" in why:
                raise InvalidRequestError(f"constrained output stopped at token {token}: the grammar is too complex "
                                          f"for the parser ({why})")
            raise InvalidRequestError(f"constrained output rejected token {token}: {why}")

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
        from betelgeuse.gguf.vocab import UNUSED
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

    def bad_tool(self, tools: list[dict], name: str | None) -> InvalidRequestError | None:
        """After a forced tool call's grammar failed to compile: the first function whose parameters schema fails
        alone, named (the grammar's own error points into the generated Lark text) -> the error, or None."""
        for fname, params in _functions(tools, name).items():
            try:
                self.constraint(Grammar("json_schema", params))
            except InvalidRequestError as e:
                why = str(e).removeprefix("invalid json schema: ").removeprefix("json_schema: ")
                return InvalidRequestError(f"tool {fname!r}: its parameters schema cannot constrain a forced call "
                                           f"(tool_choice): {why}")
        return None

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
