"""The live service abused as users do, its books read after each round: a real store + worker + HTTP edge on the
synth `tiny` model (CPU, or --device cuda), driven over raw sockets (no client library hides a disconnect).

    OMP_NUM_THREADS=1 .venv/bin/python tests/scripts/soak_service.py [--rounds 6] [--clients 28] [--kills 4]
        [--model m.gguf] [--device cuda]

Each round: `--clients` streaming requests spread over /v1/chat/completions, /v1/messages, /v1/responses and
/v1/completions (structured output, forced tool calls, stop strings, seeded sampling, logprobs), most of them
disconnected after a few reads (some before the first byte, some queued past max_running / max_queue). Then
`--kills` rounds of the same with a `kill -9` of the worker or the store mid-stream and a restart. After every round
the service must be idle-clean: no request running or waiting, no K/V, no prefix-cache block held, no staging slot
handed to the worker and none taken back from a failed pass (store status), and a greedy completion equal to the
one the fresh service gave. Prints one line per round (with the processes' RSS) and a verdict: "soak: OK" or
"soak: FAILED (...)", exit 1.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import service_helpers as h  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PROMPT = "Tell me a long story about the sea and the ships " * 3


def bodies(model: str) -> list[tuple[str, dict]]:
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 60, "stream": True}
    return [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": SCHEMA}}, "logprobs": True, "top_logprobs": 3}),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": PARAMS}}], "tool_choice": "required"}),
        ("/v1/chat/completions", {**chat, "stop": ["the", "a b"], "temperature": 0.7, "seed": 3}),
        ("/v1/messages", {**chat, "tools": [{"name": "get_weather", "input_schema": PARAMS}],
                          "tool_choice": {"type": "any"}}),
        ("/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": 60, "stream": True}),
        ("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 60, "stream": True}),
    ]


def post(addr: tuple[str, int], path: str, body: dict, reads: int | None = None, timeout: float = 60) -> bytes:
    """One HTTP/1.1 request; reads=k: the client goes away after k reads (0: right after sending)."""
    data = json.dumps(body).encode()
    with socket.create_connection(addr, timeout=timeout) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        out = b""
        for _ in range(10**9 if reads is None else reads):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the synth tiny preset, written to a temporary directory)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=28)
    ap.add_argument("--kills", type=int, default=4)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    model = Path(a.model) if a.model else tmp / "tiny.gguf"
    if not a.model:
        from betelgeuse.gguf.synth import PRESETS, write_model
        write_model(model, PRESETS["tiny"], progress=False)
    c = h.start_cluster(model, tmp / "run", http="auto", settings={"worker.device": a.device})
    addr = (c.http.split(":")[0], int(c.http.split(":")[1]))
    failures: list[str] = []
    try:
        mid = json.load(urllib.request.urlopen(f"http://{c.http}/v1/models", timeout=10))["data"][0]["id"]

        def greedy() -> str:
            raw = post(addr, "/v1/completions", {"model": mid, "prompt": "Hello there", "max_tokens": 12,
                                                 "temperature": 0, "logprobs": 2})
            return json.dumps(json.loads(raw.split(b"\r\n\r\n", 1)[1])["choices"][0])

        def books() -> dict:
            w = h.scrape(c.worker_metrics_url)
            st = _store_status(c)
            rss = {p.name: int(open(f"/proc/{p.pid}/status").read().split("VmRSS:")[1].split()[0]) >> 10
                   for p in (c.store, c.worker)}
            return {"running": h.value(w, "betelgeuse_requests_running"),
                    "waiting": h.value(w, "betelgeuse_requests_waiting"),
                    "kv_tokens": h.value(w, "betelgeuse_kv_cache_tokens"),
                    "prefix_held": h.value(w, "betelgeuse_prefix_cache_held_blocks"),
                    "staging_handed": st["staging_handed"], "staging_reclaimed": st["staging_reclaimed"],
                    "rss_mib": rss}

        def idle(tag: str, want: str):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20:
                b = books()
                if not (b["running"] or b["waiting"] or b["kv_tokens"] or b["prefix_held"] or b["staging_handed"]):
                    break
                time.sleep(0.2)
            same = greedy() == want
            print(f"{tag}: {b} greedy_same={same}", flush=True)
            bad = [k for k in ("running", "waiting", "kv_tokens", "prefix_held", "staging_handed",
                               "staging_reclaimed") if b[k]]
            if bad or not same:
                failures.append(f"{tag}: {', '.join(bad) or 'greedy output changed'}")

        want = greedy()
        kinds = bodies(mid)
        for rnd in range(a.rounds + a.kills):
            rng = random.Random(rnd)
            threads = []
            for i in range(a.clients):
                path, body = kinds[i % len(kinds)]
                reads = None if i % 5 == 0 else rng.randint(0, 6)
                threads.append(threading.Thread(target=post, args=(addr, path, body, reads), daemon=True))
            for t in threads:
                t.start()
            tag = f"round {rnd}"
            if rnd >= a.rounds:
                time.sleep(0.5 + 0.3 * (rnd % 2))
                who = ("worker", "store")[rnd % 2]
                getattr(c, who).kill9()
                (c.start_worker if who == "worker" else c.start_store)()
                tag += f" (kill -9 of the {who})"
            for t in threads:
                t.join(120)
            if rnd >= a.rounds and rnd % 2:              # the worker re-attaches to the new store by itself
                t0 = time.monotonic()
                while time.monotonic() - t0 < 30:
                    try:
                        greedy()
                        break
                    except (OSError, KeyError, ValueError):
                        time.sleep(0.5)
            idle(tag, want)
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("soak: OK" if not failures else f"soak: FAILED ({'; '.join(failures)})")
    return 1 if failures else 0


def _store_status(c) -> dict:
    import grpc
    from services.pb.betelgeuse.v1 import store_pb2, store_pb2_grpc
    with grpc.insecure_channel(f"unix:{c.store_socket}") as ch:
        return json.loads(store_pb2_grpc.ExpertStoreStub(ch).Status(store_pb2.StatusRequest(), timeout=5).json)


if __name__ == "__main__":
    sys.exit(main())
