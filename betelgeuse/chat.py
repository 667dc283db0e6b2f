"""A small client of the OpenAI-compatible HTTP API for `betelgeuse chat`: the standard library only (urllib,
server-sent events read line by line), so that the CLI needs neither the `openai` package nor FastAPI."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Callable

from betelgeuse.errors import BetelgeuseError


class ChatClient:
    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.model = model or self._get("/v1/models")["data"][0]["id"]

    def _open(self, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
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

    def stream(self, messages: list[dict], on_text: Callable[[str], None], **params) -> str:
        """POST /v1/chat/completions with stream=true; on_text(delta) for each piece; returns the whole answer."""
        body = {"model": self.model, "messages": messages, "stream": True,
                **{k: v for k, v in params.items() if v is not None}}
        out = []
        with self._open("/v1/chat/completions", body) as r:
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
                    text = (c.get("delta") or {}).get("content")
                    if text:
                        out.append(text)
                        on_text(text)
        return "".join(out)
