"""`betelgeuse chat`: an interactive chat over the OpenAI-compatible HTTP API. The standard library only (urllib,
server-sent events read line by line, readline), so that the CLI needs neither the `openai` package nor FastAPI.

    ChatClient(url, model, api_key).stream(messages, on_text, on_reasoning, **params) -> (answer, interrupted)
    ChatSession(client, ...).run(input_fn)        # the loop: slash commands here, the rest to the model

Each turn resends the whole conversation (as agents do). Ctrl-C while an answer streams stops that answer (the
connection is closed, so the server cancels the request) and keeps the conversation; Ctrl-C at the prompt clears
the line; Ctrl-D or /exit leaves. Lines starting with "/" are commands handled here, never sent to the model
("//" sends one literal "/"). On a terminal, input has line editing and a history kept across sessions.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from betelgeuse.errors import BetelgeuseError

DEFAULT_MAX_TOKENS = 2048          # per answer: a runaway random or looping model stops here, not at the context


def default_max_tokens(context: int) -> int:
    """DEFAULT_MAX_TOKENS, or half the context when that is smaller: the server refuses (400) a max_tokens that the
    prompt plus the answer cannot fit, and a chat's prompt grows every turn."""
    return min(DEFAULT_MAX_TOKENS, context // 2) if context > 1 else DEFAULT_MAX_TOKENS
HISTORY_LINES = 1000


class ChatClient:
    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0, api_key: str | None = None):
        self.url, self.timeout, self.api_key = url.rstrip("/"), timeout, api_key
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        card = self._get("/v1/models")["data"][0]
        self.model = model or card["id"]
        self.context = int(card.get("max_model_len") or 0)     # tokens (0: not said)

    def _open(self, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = e.reason
            raise BetelgeuseError(f"HTTP {e.code}: {msg}") from None
        except (urllib.error.URLError, OSError) as e:
            raise BetelgeuseError(f"cannot reach the API at {self.url}: {getattr(e, 'reason', e)}") from None

    def _get(self, path: str) -> dict:
        with self._open(path) as r:
            return json.loads(r.read())

    def stream(self, messages: list[dict], on_text: Callable[[str], None],
               on_reasoning: Callable[[str], None] | None = None, **params) -> tuple[str, bool]:
        """POST /v1/chat/completions with stream=true; on_text(delta) for each piece of the answer (on_reasoning
        for the reasoning's). Returns (the answer, interrupted): Ctrl-C closes the stream and keeps what came."""
        body = {"model": self.model, "messages": messages, "stream": True,
                **{k: v for k, v in params.items() if v is not None}}
        out = []
        r = self._open("/v1/chat/completions", body)
        try:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    raise BetelgeuseError(ev["error"]["message"])
                for c in ev.get("choices", []):
                    delta = c.get("delta") or {}
                    if delta.get("reasoning_content") and on_reasoning:
                        on_reasoning(delta["reasoning_content"])
                    if delta.get("content"):
                        out.append(delta["content"])
                        on_text(delta["content"])
        except KeyboardInterrupt:
            return "".join(out), True
        finally:
            r.close()                    # an unfinished stream: the server sees the client go and cancels
        return "".join(out), False


HELP = """commands (not sent to the model):
  /help                  this list
  /reset                 start the conversation over (keeps the system message)
  /system TEXT           set the system message (and start over)
  /set NAME VALUE        temperature, top_p, seed, max_tokens (a number, or "none")
  /thinking on|off       the chat template's thinking switch (enable_thinking)
  /show                  the model, the settings and the conversation's length
  /exit, /quit           leave (also Ctrl-D)
Ctrl-C stops an answer; the conversation goes on. Start a message with // to send one literal /."""


@dataclass
class ChatSession:
    client: ChatClient
    system: str | None = None
    params: dict = field(default_factory=dict)       # temperature, top_p, seed, max_tokens
    thinking: bool | None = None
    out: object = None                               # where answers go (stdout)
    err: object = None                               # where the rest goes (stderr)
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.out = self.out or sys.stdout
        self.err = self.err or sys.stderr
        self.reset()

    def reset(self):
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text: str):
        print(text, file=self.err, flush=True)

    def command(self, line: str) -> bool:
        """A slash command; False to leave."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        if name in ("exit", "quit"):
            return False
        if name == "help":
            self.say(HELP)
        elif name in ("reset", "clear"):
            self.reset()
            self.say("(conversation cleared)")
        elif name == "system":
            self.system = arg or None
            self.reset()
            self.say("(system message set; conversation cleared)" if arg else "(system message removed)")
        elif name == "set":
            key, _, value = arg.partition(" ")
            kinds = {"temperature": float, "top_p": float, "seed": int, "max_tokens": int}
            if key not in kinds:
                self.say(f"/set: one of {', '.join(kinds)}")
                return True
            try:
                self.params[key] = None if value.strip() == "none" else kinds[key](value)
            except ValueError:
                self.say(f"/set {key}: {value!r} is not a {kinds[key].__name__}")
        elif name == "thinking":
            if arg not in ("on", "off"):
                self.say("/thinking on|off")
            else:
                self.thinking = arg == "on"
        elif name == "show":
            self.say(f"model {self.client.model} at {self.client.url}; " +
                     ", ".join(f"{k}={v}" for k, v in self.params.items()) +
                     f"; thinking={'default' if self.thinking is None else self.thinking}; "
                     f"{sum(m['role'] != 'system' for m in self.history)} messages")
        else:
            self.say(f"unknown command /{name} (/help lists them; // sends a literal /)")
        return True

    def turn(self, text: str):
        self.history.append({"role": "user", "content": text})
        extra = {"chat_template_kwargs": {"enable_thinking": self.thinking}} if self.thinking is not None else {}
        tty = hasattr(self.out, "isatty") and self.out.isatty()

        def reasoning(t: str):           # shown dimmed on a terminal, left out of pipes
            if tty:
                print(f"\x1b[2m{t}\x1b[0m", end="", file=self.out, flush=True)
        try:
            answer, stopped = self.client.stream(self.history, lambda t: print(t, end="", file=self.out, flush=True),
                                                 reasoning, **self.params, **extra)
        except BetelgeuseError as e:
            self.history.pop()
            print(f"\nbetelgeuse: error: {e}", file=self.err, flush=True)
            return
        except KeyboardInterrupt:        # before the answer began
            self.history.pop()
            self.say("\n(stopped)")
            return
        print(file=self.out, flush=True)
        if stopped:
            self.say("(answer stopped)")
        self.history.append({"role": "assistant", "content": answer})

    def run(self, read: Callable[[str], str], prompt: str = "") -> int:
        while True:
            try:
                line = read(prompt)
            except EOFError:
                return 0
            except KeyboardInterrupt:    # at the prompt: drop the line, stay
                print(file=self.err)
                continue
            stripped = line.strip()
            if not stripped:
                continue
            if stripped.startswith("//"):
                self.turn(line.lstrip()[1:])
            elif stripped.startswith("/"):
                if not self.command(stripped):
                    return 0
            else:
                self.turn(line)


def history_file() -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "betelgeuse", "chat_history")


def line_editing() -> Callable[[], None]:
    """readline (arrow keys, editing, history across sessions) for input(); returns the function that saves it."""
    try:
        import readline
    except ImportError:
        return lambda: None
    path = history_file()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(HISTORY_LINES)

    def save():
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    return save
