"""TTFT of a repeated prompt after `kill -9` of the worker (answered from the prefix cache's host tier, which the
store keeps) against the same prompt recomputed (the host tier off), and after a restart of the whole service (store
and worker stopped with SIGTERM and started again: answered from the tier the store saved to [store]
prefix_save_path and loaded back) against the same restart with the setting off, on real processes (CPU).

    .venv/bin/python tests/scripts/prefix_restart_ttft.py [--model m.gguf | --preset ds41-tiny] [--tokens 512]
        [--device cuda]

Prints one line per case: the TTFT the worker measured (usage.ttft_ms, arrival to first token) and the prompt
tokens it took from the cache (usage.cached_tokens). Without --model it writes the synth --preset (default `tiny`,
qwen3moe's K/V blocks; `ds4-tiny` / `ds41-tiny`: deepseek4's / deepseek41's snapshots, worker/snapshot_host.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.grpc.client import generate_stream  # noqa: E402
from services.launcher import Cluster  # noqa: E402


def final(c: Cluster, ids: list[int]):
    return list(generate_stream(c.address, prompt_ids=ids, max_tokens=1, ignore_eos=True))[-1].final


def run(model: str, ids: list[int], host_bytes: str, tmp: str, device: str, save: str | None = None) -> tuple:
    """save None: kill -9 of the worker between the two requests; else a stop and start of both processes with
    [store] prefix_save_path = save ("" = off)."""
    settings = {"engine.prefix_host_bytes": host_bytes, "engine.max_context": 2048}
    if save is not None:
        settings["store.prefix_save_path"] = save
    c = Cluster(model, tmp, device=device, settings=settings, worker_metrics="", store_metrics="")
    try:
        c.start_store()
        c.start_worker()
        first = final(c, ids)
        if save is None:
            c.worker.kill9()                 # what the supervisor (serve, systemd) then does: start it again
        else:
            c.stop()                         # `systemctl restart betelgeuse`: worker, then store, SIGTERM
            c.start_store()
        c.start_worker()
        again = final(c, ids)
        assert list(again.token_ids) == list(first.token_ids), "the repeated prompt gave other tokens"
        return first.usage, again.usage
    finally:
        c.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--preset", default="tiny", help="the synth preset written when --model is not given")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    o = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefix-restart-") as tmp:
        model, vocab = o.model, 1000
        if not model:
            from betelgeuse.gguf.synth import spec_from_preset, write_model
            model = str(Path(tmp) / f"{o.preset}.gguf")
            spec = spec_from_preset(o.preset)
            write_model(model, spec, progress=False)
            vocab = min(vocab, spec.n_vocab)
        ids = [int(x) for x in np.random.default_rng(0).integers(3, vocab, o.tokens)]
        for name, host in (("host tier on (auto)", "auto"), ("host tier off (recompute)", "0")):
            first, again = run(model, ids, host, str(Path(tmp) / host), o.device)
            print(f"{name:27s} first {first.ttft_ms:8.1f} ms | after kill -9 of the worker: TTFT "
                  f"{again.ttft_ms:8.1f} ms, cached_tokens {again.cached_tokens}/{again.prompt_n}")
        for name, save in (("saved to disk", str(Path(tmp) / "prefix-cache.bin")), ("not saved (recompute)", "")):
            first, again = run(model, ids, "auto", str(Path(tmp) / f"full{bool(save)}"), o.device, save)
            print(f"{name:27s} first {first.ttft_ms:8.1f} ms | after a restart of store and worker: TTFT "
                  f"{again.ttft_ms:8.1f} ms, cached_tokens {again.cached_tokens}/{again.prompt_n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
