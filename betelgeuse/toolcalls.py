"""Tool calls in model output, in the syntax of the model's family (the chat template says which one):

Hermes (Qwen2.5/Qwen3; vLLM's `hermes` parser is the anchor)::

    I'll check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

DeepSeek-V4 DSML (DeepSeek's `encoding_dsv4`; vLLM's `deepseek_v4` parser is the anchor): one block holds one or
more invokes; a parameter is raw text (string="true") or JSON (string="false")::

    I'll check.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`ToolCallStream` turns streamed text deltas into content deltas and whole tool calls; calls go out when their
block's closing tag arrives (OpenAI clients accept the arguments of a call in any number of pieces, here one).
Text that may be the start of the opening tag is held back until it is or is not, and so is whitespace that may
turn out to stand just before a block (it belongs to the markup: templates write content + "\\n" + block). Nothing
else is dropped: a block that does not parse is passed on as content, exactly as it was written.
`parse_tool_calls` is the same parser over a whole completion, so streamed and non-streamed results agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from betelgeuse.api import ToolCall


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name, args) -> ToolCall | None:
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False))


def _hermes_body(body: str) -> list[ToolCall] | None:
    """'{"name": ..., "arguments": {...}}' -> [ToolCall], or None when it is not a valid call."""
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                 # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    call = _call(obj.get("name"), args)
    return None if call is None else [call]


DSML = "｜DSML｜"
_INVOKE = re.compile(r'\s*<' + DSML + r'invoke\s+name="([^"]+)"\s*>(.*?)</' + DSML + r'invoke>\s*', re.S)
_PARAM = re.compile(r'\s*<' + DSML + r'parameter\s+name="([^"]+)"(?:\s+string="(true|false)")?\s*>(.*?)</' + DSML
                    + r'parameter>\s*', re.S)


def _dsml_value(text: str, is_string: str | None):
    if is_string == "false":
        try:
            return json.loads(text)
        except ValueError:
            return text                        # as vLLM: a value that is not JSON stays the raw text
    return text


def _dsml_body(body: str) -> list[ToolCall] | None:
    """The invokes of one <｜DSML｜tool_calls> block -> ToolCalls; None unless the block is only invokes."""
    calls, pos = [], 0
    while pos < len(body):
        m = _INVOKE.match(body, pos)
        if m is None:
            return None if body[pos:].strip() else calls or None
        args, ppos, inner = {}, 0, m.group(2)
        while ppos < len(inner):
            pm = _PARAM.match(inner, ppos)
            if pm is None:
                if inner[ppos:].strip():
                    return None
                break
            args[pm.group(1)] = _dsml_value(pm.group(3), pm.group(2))
            ppos = pm.end()
        call = _call(m.group(1), args)
        if call is None:
            return None
        calls.append(call)
        pos = m.end()
    return calls or None


@dataclass(frozen=True, slots=True)
class Syntax:
    """How one family writes tool calls: a block between `open` and `close` whose body `parse` turns into calls."""
    name: str
    open: str
    close: str
    parse: Callable[[str], list[ToolCall] | None]


HERMES = Syntax("hermes", "<tool_call>", "</tool_call>", _hermes_body)
DSML_V4 = Syntax("deepseek_v4", "<" + DSML + "tool_calls>", "</" + DSML + "tool_calls>", _dsml_body)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (text that may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStream:
    """push(delta) / flush() -> list of ("content", str) | ("tool_call", ToolCall), in output order.
    Whitespace before, between or after tool calls is not content (as vLLM's parsers drop it)."""

    def __init__(self, syntax: Syntax = HERMES):
        self.syntax = syntax
        self.buf = ""               # text not yet classified
        self.in_call = False        # inside a block, waiting for its close tag
        self.ws = ""                # the whitespace held back before the block (content again if it fails)
        self.n_calls = 0

    def _content(self, text: str, out: list):
        if text and not (self.n_calls and not text.strip()):
            out.append(("content", text))

    def push(self, delta: str) -> list:
        out: list = []
        s = self.syntax
        self.buf += delta
        while True:
            if self.in_call:
                end = self.buf.find(s.close)
                if end < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(s.close):], False
                calls = s.parse(body)
                if calls is None:
                    self._content(self.ws + s.open + body + s.close, out)
                else:
                    out += [("tool_call", c) for c in calls]
                    self.n_calls += len(calls)
                continue
            start = self.buf.find(s.open)
            if start >= 0:
                before, self.buf, self.in_call = self.buf[:start], self.buf[start + len(s.open):], True
                self.ws = before[len(before.rstrip()):]
                self._content(before.rstrip(), out)
                continue
            # hold back what may become the open tag, and the whitespace before it
            keep = partial_suffix(self.buf, s.open)
            ready = self.buf[:len(self.buf) - keep]
            ready = ready.rstrip()
            self._content(ready, out)
            self.buf = self.buf[len(ready):]
            return out

    def flush(self) -> list:
        """End of the completion: an unclosed block is parsed as it stands (vLLM accepts a missing close tag)."""
        out: list = []
        s = self.syntax
        if self.in_call:
            body = self.buf
            n = partial_suffix(body, s.close)              # a close tag cut short by max_tokens
            calls = s.parse(body[:len(body) - n] if n else body)
            if calls is None:
                self._content(self.ws + s.open + self.buf, out)
            else:
                out += [("tool_call", c) for c in calls]
                self.n_calls += len(calls)
        else:
            self._content(self.buf, out)
        self.buf, self.in_call = "", False
        return out


def parse_tool_calls(text: str, syntax: Syntax = HERMES) -> tuple[str, list[ToolCall]]:
    """A whole completion -> (content, tool calls); content is "" when there is none."""
    s = ToolCallStream(syntax)
    items = s.push(text) + s.flush()
    return "".join(x for k, x in items if k == "content"), [x for k, x in items if k == "tool_call"]
