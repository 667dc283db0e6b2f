"""Tool calls in model output, Hermes style (what Qwen3 emits; vLLM's `hermes` tool parser is the anchor):

    I'll check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

`ToolCallStream` turns streamed text deltas into content deltas and whole tool calls; a call goes out when
its closing tag arrives (OpenAI clients accept the arguments of a call in any number of pieces, here one).
Text that may be the start of `<tool_call>` is held back until it is or is not; nothing is ever dropped: a
call whose JSON does not parse is passed on as content, exactly as it was written. `parse_tool_calls` is the
same parser run over a whole completion, so streamed and non-streamed results agree.
"""

from __future__ import annotations

import json
import uuid

from betelgeuse.worker.api import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from_json(body: str) -> ToolCall | None:
    """'{"name": ..., "arguments": {...}}' -> ToolCall, or None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                 # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of OPEN (text that may become a tag)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


class ToolCallStream:
    """push(delta) / flush() -> list of ("content", str) | ("tool_call", ToolCall), in output order.
    Whitespace between or after tool calls is not content (as vLLM's hermes parser drops it)."""

    def __init__(self):
        self.buf = ""               # text not yet classified
        self.in_call = False        # inside <tool_call> ... waiting for </tool_call>
        self.n_calls = 0

    def _content(self, text: str, out: list):
        if not text:
            return
        if self.n_calls and not text.strip():
            return
        out.append(("content", text))

    def push(self, delta: str) -> list:
        out: list = []
        self.buf += delta
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE):], False
                call = _call_from_json(body.strip())
                if call is None:
                    self._content(OPEN + body + CLOSE, out)
                else:
                    out.append(("tool_call", call))
                    self.n_calls += 1
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                before, self.buf, self.in_call = self.buf[:start], self.buf[start + len(OPEN):], True
                if self.n_calls and not before.strip():
                    before = ""
                self._content(before, out)
                continue
            keep = _partial_open(self.buf)
            ready = self.buf[:len(self.buf) - keep]
            if self.n_calls and not ready.strip():
                # whitespace after a call: hold it until we know whether more content follows
                return out
            self._content(ready, out)
            self.buf = self.buf[len(ready):]
            return out

    def flush(self) -> list:
        """End of the completion: an unclosed call is parsed as it stands (vLLM accepts a missing close tag)."""
        out: list = []
        if self.in_call:
            body = self.buf
            for n in range(len(CLOSE) - 1, 0, -1):        # a close tag cut short by max_tokens
                if body.endswith(CLOSE[:n]):
                    body = body[:-n]
                    break
            call = _call_from_json(body.strip())
            if call is None:
                self._content(OPEN + self.buf, out)
            else:
                out.append(("tool_call", call))
                self.n_calls += 1
        else:
            self._content(self.buf, out)
        self.buf, self.in_call = "", False
        return out


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole completion -> (content, tool calls); content is "" when there is none."""
    s = ToolCallStream()
    items = s.push(text) + s.flush()
    return "".join(x for k, x in items if k == "content"), [x for k, x in items if k == "tool_call"]
