"""Reasoning and tool calls as each model family writes them, chosen from the model's chat template.

    d = dialect_for(tokenizer.chat_template, arch)          # Qwen3/Hermes, DeepSeek-V4/DSML, ...
    open_ = d.opens_reasoning(prompt_tail)                   # the rendered prompt left a think block open
    p = OutputParser(d, open_, tools=True)
    p.push(delta) / p.flush()  -> [("reasoning", str) | ("content", str) | ("tool_call", ToolCall), ...]
    parse_output(d, text, open_, tools=True) -> Parsed(reasoning, content, calls)   # the same over a whole text

Reasoning is the text of a think block: either the prompt opened it (Qwen3-2507 thinking templates end the
generation prompt with `<think>\\n`, DeepSeek-V4's thinking mode with `<think>`) or the output opens it at its very
start (Qwen3 writes `<think>` itself); it ends at `</think>`. Reasoning is never parsed for tool calls: a call
written while thinking is not executed. Whitespace at the edges of the reasoning, and between `</think>` and the
answer, is markup, not text. The streaming form emits the same split as the whole-text form, delta by delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from betelgeuse.api import ToolCall
from betelgeuse.toolcalls import DSML, DSML_V4, HERMES, Syntax, ToolCallStream, partial_suffix


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str                       # "qwen3" | "deepseek_v4" | "hermes"
    tools: Syntax                   # how it writes tool calls
    think_open: str | None = None   # None: the family does not reason in think blocks
    think_close: str | None = None
    think_sep: str = ""             # what the template writes between </think> and the answer

    def opens_reasoning(self, prompt_tail: str) -> bool:
        """The rendered prompt (its last characters) ends inside a think block."""
        if self.think_open is None:
            return False
        tail = prompt_tail.rstrip()
        return tail.endswith(self.think_open)


QWEN3 = Dialect("qwen3", HERMES, "<think>", "</think>", "\n\n")
DEEPSEEK_V4 = Dialect("deepseek_v4", DSML_V4, "<think>", "</think>")
HERMES_ONLY = Dialect("hermes", HERMES)


def dialect_for(chat_template: str | None, arch: str = "") -> Dialect:
    """The dialect the chat template teaches the model (its tool-call markup and think tags); the architecture
    decides only when the GGUF has no template."""
    t = chat_template or ""
    if DSML in t:
        return DEEPSEEK_V4
    if "<tool_call>" in t:
        return QWEN3 if "<think>" in t or "</think>" in t else HERMES_ONLY
    if not t and arch.startswith("deepseek4"):
        return DEEPSEEK_V4
    if "<think>" in t or not t:
        return QWEN3
    return HERMES_ONLY


@dataclass(slots=True)
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class OutputParser:
    """One completion's text deltas -> reasoning / content / tool-call items (see the module doc)."""

    # states: START (nothing classified yet: the output may still open a think block), THINK, ANSWER
    START, THINK, ANSWER = 0, 1, 2

    def __init__(self, dialect: Dialect, reasoning_open: bool = False, tools: bool = False):
        self.d = dialect
        thinks = dialect.think_open is not None
        self.state = self.THINK if (reasoning_open and thinks) else self.START if thinks else self.ANSWER
        self.lead = self.state == self.THINK   # at the start of the reasoning, or of the answer after </think>:
                                                # leading whitespace is markup
        self.buf = ""                   # text not yet classified (a possible tag, or held whitespace)
        self.calls = ToolCallStream(dialect.tools) if tools else None

    def _answer(self, text: str, out: list):
        if self.lead:
            text = text.lstrip()
            if not text:
                return
            self.lead = False
        if self.calls is None:
            if text:
                out.append(("content", text))
        else:
            out += self.calls.push(text)

    def push(self, delta: str) -> list:
        out: list = []
        self.buf += delta
        while self.buf:
            if self.state == self.START:
                head = self.buf.lstrip()
                op = self.d.think_open
                if head.startswith(op):
                    self.buf, self.state, self.lead = head[len(op):], self.THINK, True
                    continue
                if op.startswith(head):             # whitespace, or a part of the tag: wait
                    return out
                self.state, self.lead = self.ANSWER, False
                continue
            if self.state == self.THINK:
                cl = self.d.think_close
                end = self.buf.find(cl)
                if end >= 0:
                    self._reasoning(self.buf[:end].rstrip(), out)
                    self.buf, self.state, self.lead = self.buf[end + len(cl):], self.ANSWER, True
                    continue
                keep = partial_suffix(self.buf, cl)
                ready = self.buf[:len(self.buf) - keep].rstrip()     # trailing whitespace may precede </think>
                self._reasoning(ready, out)
                self.buf = self.buf[len(ready):]
                return out
            text, self.buf = self.buf, ""
            self._answer(text, out)
        return out

    def _reasoning(self, text: str, out: list):
        if self.lead:
            text = text.lstrip()
            if text:
                self.lead = False
        if text:
            out.append(("reasoning", text))

    def flush(self) -> list:
        """The end of the completion: held text goes where it stands (an unclosed think block is reasoning)."""
        out: list = []
        text, self.buf = self.buf, ""
        if self.state == self.THINK:
            self._reasoning(text.rstrip(), out)
        elif text:
            self._answer(text, out)
        if self.calls is not None:
            out += self.calls.flush()
        return out


def parse_output(dialect: Dialect, text: str, reasoning_open: bool = False, tools: bool = False) -> Parsed:
    p = OutputParser(dialect, reasoning_open, tools)
    return collect(p.push(text) + p.flush())


def collect(items: list) -> Parsed:
    out = Parsed()
    out.reasoning = "".join(x for k, x in items if k == "reasoning")
    out.content = "".join(x for k, x in items if k == "content")
    out.calls = [x for k, x in items if k == "tool_call"]
    return out
