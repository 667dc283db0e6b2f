"""The live worker's threads while one answer streams, by client: raw HTTP /v1/completions, the `openai` client's
streamed chat completion, and gRPC Generate; each thread's wakeups (context switches: services/bench/threads.py) from
the first streamed token to the last, exact totals and per token. Store and worker processes, real sockets, the
model ds4-tiny (seeded random weights) on the CPU. Prints markdown tables; writes census.json.

    PYTHONPATH=TREE python docs/benchmarks/cpu-stream66/census.py --label after [--tokens 64] [--reps 2]
        [--device cpu] [--out /tmp/stream66-census]
    python docs/benchmarks/cpu-stream66/census.py --tables A/census.json B/census.json   # side by side, run nothing

TREE is the checkout whose worker runs (services.launcher starts the children from the tree it is imported from):
this branch for "after", an export of main for "before". The worker's Python threads carry kernel names set by
../cpu-gil66/shim/sitecustomize.py ("py:" + the Python name, cut to 15 bytes; the main thread "py:main"): those take
the GIL; the rest are gRPC's C threads. Window: the census reads /proc when the client sees the first token and
again when it sees the last (a greedy answer of --tokens tokens, ignore_eos), so per token = over --tokens - 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE.parent / "cpu-gil66" / "shim"


class Window:
    """The census between the first token the client sees and the last (n tokens)."""

    def __init__(self, pids: dict, n: int):
        from services.bench.threads import Census
        self.census, self.n, self.seen, self.res = Census(pids), n, 0, None

    def tokens(self, k: int):
        if k <= 0:
            return
        if self.seen == 0:
            self.census.start()
        self.seen += k
        if self.seen >= self.n and self.res is None:
            self.res = self.census.stop(1)          # exact totals: per token is done by the table


def http_raw(c, model_id: str, ids: list[int], n: int, w: Window):
    """/v1/completions streamed over http.client; logprobs 0: one chunk per token, its entry in logprobs.tokens."""
    import http.client
    host, port = c.http.rsplit(":", 1)
    body = {"model": model_id, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "stream": True}
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()[:300]
        for line in r:
            if line.startswith(b"data: {"):
                for ch in json.loads(line[6:]).get("choices", []):
                    w.tokens(len((ch.get("logprobs") or {}).get("tokens") or ()))
    finally:
        conn.close()


def openai_chat(c, model_id: str, ids: list[int], n: int, w: Window):
    """The official client's streamed chat completion; logprobs: every token's entry arrives in some chunk."""
    import openai
    cl = openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    s = cl.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Tell me a story"}],
                                   max_tokens=n, temperature=0, logprobs=True, stream=True,
                                   extra_body={"ignore_eos": True})
    for chunk in s:
        for ch in chunk.choices:
            w.tokens(len((ch.logprobs.content or []) if ch.logprobs else []))


def grpc_generate(c, model_id: str, ids: list[int], n: int, w: Window):
    import grpc
    from services.pb.betelgeuse.v1 import inference_pb2 as pb
    from services.pb.betelgeuse.v1 import inference_pb2_grpc as pb_grpc
    req = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0), ignore_eos=True, max_tokens=n)
    req.prompt_ids.ids.extend(ids)
    with grpc.insecure_channel(c.address) as ch:
        for r in pb_grpc.InferenceServiceStub(ch).Generate(req, timeout=300):
            w.tokens(1 if r.HasField("token") else 0)


CLIENTS = {"http": http_raw, "openai": openai_chat, "grpc": grpc_generate}


def run(a) -> dict:
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    from services.launcher import Cluster
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / f"{a.preset}.gguf"
    if not model.exists():
        write_model(model, spec_from_preset(a.preset), progress=False)
    os.environ["PYTHONPATH"] = str(SHIM)            # the children's thread names (module doc)
    v, h = a.slots.split("+")
    c = Cluster(str(model), str(out / f"serve-{a.label}"), device=a.device, http="auto",
                settings={"slots.vram_per_layer": int(v), "slots.host_per_layer": int(h)})
    runs = []
    try:
        c.start_store()
        c.start_worker()
        import services.launcher as launcher
        from services.bench.serve import Client
        model_id = Client(c.http).get("/v1/models")[1]["data"][0]["id"]
        pids = {"worker": c.worker.pid, "store": c.store.pid}
        for name in a.clients.split(","):
            CLIENTS[name](c, model_id, list(range(3, 7)), 4, Window(pids, 4))      # warm-ups out of the windows
        for rep in range(a.reps):
            for name in a.clients.split(","):
                w = Window(pids, a.tokens)
                t0 = time.perf_counter()
                CLIENTS[name](c, model_id, list(range(11 + rep, 19 + rep)), a.tokens, w)
                assert w.res is not None, f"{name}: {w.seen} of {a.tokens} tokens"
                runs.append({"client": name, "rep": rep, "tokens": a.tokens, "seconds": round(time.perf_counter()
                             - t0, 3), "threads": w.res})
        tree = str(Path(launcher.__file__).resolve().parents[1])
    finally:
        c.stop()
    return {"label": a.label, "tree": tree, "preset": a.preset, "slots": a.slots, "device": a.device, "runs": runs}


def table(results: list[dict], proc: str = "worker") -> list[str]:
    """Rows: threads; columns: (label, client, rep); cells: wakeups a token (voluntary + preempted), exact total."""
    cols = [(r["label"], x) for r in results for x in r["runs"]]
    names: list[str] = []
    for _, x in cols:
        for k in x["threads"][proc].get("threads", {}):
            if k not in names:
                names.append(k)
    head = [f"{lab} {x['client']}#{x['rep']}" for lab, x in cols]
    out = [f"| {proc} thread (x threads) | " + " | ".join(head) + " |", "|---|" + "---|" * len(cols)]
    for k in names:
        cells, n = [], 0
        for _, x in cols:
            t = x["threads"][proc].get("threads", {}).get(k)
            if t is None:
                cells.append("0")
                continue
            n = max(n, t["threads"])
            per = x["tokens"] - 1
            cells.append(f"{(t['wakeups'] - t['involuntary']) / per:.2f} + {t['involuntary'] / per:.2f} "
                         f"({t['wakeups']:.0f})")
        out.append(f"| {k} (x{n}) | " + " | ".join(cells) + " |")
    out.append("| tokens in the window / s the request | " + " | ".join(f"{x['tokens'] - 1} / {x['seconds']}"
                                                                      for _, x in cols) + " |")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="after")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--preset", default="ds4-tiny")
    p.add_argument("--slots", default="2+3")
    p.add_argument("--device", default="cpu", help="the worker's device (cuda on the GPU machine)")
    p.add_argument("--clients", default="http,openai,grpc")
    p.add_argument("--out", default="/tmp/stream66-census")
    p.add_argument("--tables", nargs="+", help="print the tables of these census.json files side by side")
    a = p.parse_args()
    if a.tables:
        results = [json.loads(Path(f).read_text()) for f in a.tables]
    else:
        results = [run(a)]
        (Path(a.out) / "census.json").write_text(json.dumps(results[0], indent=1))
    for proc in ("worker", "store"):
        print(f"\n{proc} process: wakeups a token, voluntary + preempted (exact total in the window)\n")
        print("\n".join(table(results, proc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
