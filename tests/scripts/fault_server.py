"""The worker's two real edges (gRPC: services/grpc/server.py; HTTP: services/http/app.py + server.py) over an engine
that fails on request, for tests/services/test_edge.py's walk of the error table.

    python tests/scripts/fault_server.py --grpc 127.0.0.1:P --http 127.0.0.1:Q [--log-format json]
    ... --list: first print the names of the error classes the worker defines (the table to walk), one JSON line

The engine reads the fault from the request's text (a prompt, the last message's content, Responses' input):
"raise:NAME" raises the error class NAME (any BetelgeuseError subclass, or RuntimeError = a bug) when the request
is submitted, "raise:NAME:stream" after the first token; anything else is answered with one token "ok".
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from betelgeuse.errors import BetelgeuseError  # noqa: E402
from betelgeuse.logs import setup  # noqa: E402
from betelgeuse import api  # noqa: E402


def worker_error_classes() -> list[type[BaseException]]:
    """Every BetelgeuseError subclass the worker process defines (what its edges may have to report), walked here
    rather than with betelgeuse's own helper."""
    import services.http.app  # noqa: F401 (its classes join the table: ModelNotFound, ...)
    import services.http.responses  # noqa: F401
    import services.worker_main  # noqa: F401 (and everything the worker imports)
    out, todo = [], [BetelgeuseError]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    return out


def error_class(name: str) -> type[BaseException]:
    if name == "RuntimeError":
        return RuntimeError
    return next(c for c in worker_error_classes() if c.__name__ == name)


def make(name: str) -> BaseException:
    cls = error_class(name)
    e = cls.__new__(cls)                       # whatever its __init__ takes: the message is all the edges need
    Exception.__init__(e, f"injected {name}")
    return e


def fault_of(req: api.GenerateRequest) -> tuple[str, bool] | None:
    text = req.prompt_text
    if text is None and req.messages:
        text = req.messages[-1].get("content") or ""
    if not text or not text.startswith("raise:"):
        return None
    _, name, *when = text.split(":")
    return name, when == ["stream"]


class Handle:
    reasoning = False
    prompt_tokens = 1

    def __init__(self, fault):
        self.fault = fault

    def __iter__(self):
        yield api.TokenEvent(token_id=5, text="ok", index=0)
        if self.fault is not None:
            raise make(self.fault[0])
        yield api.FinalEvent(finish_reason="stop", text="ok", token_ids=[5], usage=api.Usage(prompt_n=1),
                             stop_reason="eos")

    def cancel(self):
        pass


class FaultEngine:
    tokenizer = None

    def submit(self, req: api.GenerateRequest, deadline=None):
        fault = fault_of(req)
        if fault is not None and not fault[1]:
            raise make(fault[0])
        return Handle(fault)

    def prompt_ids(self, req):
        return [5]

    def tokenize(self, text, add_special=False, parse_special=False):
        return [5]

    def detokenize(self, ids):
        return "ok"

    def is_ready(self):
        return True

    def model_info(self):
        return api.ModelInfo(name="fault", arch="qwen3moe", path="/nowhere/fault.gguf", n_layer=1, n_embd=8, n_head=1,
                             n_head_kv=1, head_dim=8, n_expert=2, n_expert_used=1, n_ff_exp=8, n_vocab=16,
                             context_length=64, quant="F32", expert_bytes=1, vram_slots_per_layer=1,
                             host_slots_per_layer=1, schedule="layer_major", sub_batch=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc")
    ap.add_argument("--http")
    ap.add_argument("--log-format", default="text")
    ap.add_argument("--list", action="store_true", help="first print the names of the worker's error classes (JSON)")
    a = ap.parse_args()
    if a.list:
        import json
        print(json.dumps([c.__name__ for c in worker_error_classes()]), flush=True)
    setup("info", a.log_format)
    from services.grpc.server import build_server, set_health
    from services.http.app import build_app
    from betelgeuse.settings import Settings
    from services.http.server import HttpServer, Limits
    engine = FaultEngine()
    server, health, _ = build_server(engine, [a.grpc])
    server.start()
    http = HttpServer(build_app(engine), a.http, Limits.of(Settings().worker))
    http.start()
    set_health(health, True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    http.stop()
    server.stop(0)


if __name__ == "__main__":
    try:
        main()
    except BetelgeuseError as e:
        print(f"betelgeuse: error: {e}", file=sys.stderr)
        sys.exit(2)
