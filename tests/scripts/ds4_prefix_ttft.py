"""TTFT of deepseek4 / deepseek41 prompts answered from the snapshot prefix cache (worker/snapshot_cache.py) against the same
prompts recomputed, side by side in one run: the in-process engine (real store, runner, scheduler), CPU by default.

    OMP_NUM_THREADS=1 .venv/bin/python tests/scripts/ds4_prefix_ttft.py [--model m.gguf | --preset ds41-tiny]
        [--tokens 1500] [--device cuda]

Cases, each on an engine with the cache on and on one with it off (prefix_cache_bytes = 0), after a warm-up:
  first     a fresh prompt P (a miss on both)
  repeated  P again (on: no pass, its first token from the cached logits)
  extended  P + a 24-token reply + 40 new tokens, an agent's next turn (on: resumed after P's last chunk boundary)
Prints usage.ttft_ms (arrival to first token) and usage.cached_tokens per case, and checks both engines gave the
same tokens. Without --model it writes the synth --preset (default `ds4-tiny`; `ds41-tiny`: deepseek41, Engram
rows from the store) with Q8_0 experts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from betelgeuse.api import GenerateRequest, SamplingParams  # noqa: E402
from betelgeuse.assembly import open_engine, open_store  # noqa: E402
from betelgeuse.config import EngineConfig  # noqa: E402


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, n)]


def gen(eng, prompt: list[int]):
    req = GenerateRequest(prompt_ids=prompt, max_tokens=2, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    evs = list(eng.submit(req))
    return [e.token_id for e in evs[:-1]], evs[-1].usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--preset", default="ds4-tiny", help="the synth preset written when --model is not given")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from betelgeuse.gguf.synth import spec_from_preset, write_model
            model = str(Path(tmp) / f"{a.preset}.gguf")
            write_model(model, replace(spec_from_preset(a.preset), expert_qtype="Q8_0", seed=2), progress=False)
        rows = {}
        for name, nbytes in (("on", "auto"), ("off", 0)):
            cfg = EngineConfig(model_path=model, device=a.device, read_threads=2, prefix_cache_bytes=nbytes,
                               max_context=a.tokens + 256)
            store = open_store(cfg)
            eng = open_engine(cfg, store)
            try:
                arch, vocab = eng.runner.mcfg.arch, eng.runner.mcfg.n_vocab
                P = ids(a.tokens, 1, vocab)
                gen(eng, ids(64, 9, vocab))                                  # warm-up
                first = gen(eng, P)
                repeated = gen(eng, P)
                ext = P + first[0] + ids(22, 2, vocab) + ids(40, 3, vocab)
                extended = gen(eng, ext)
                rows[name] = {"first": first, "repeated": repeated, "extended": extended}
            finally:
                eng.close()
                store.close()
    print(f"{arch} prefix reuse, {a.tokens}-token prompt, {a.device}: TTFT ms (cached tokens)")
    print(f"{'case':10s} {'cache off':>16s} {'cache on':>16s}")
    for case in ("first", "repeated", "extended"):
        on, off = rows["on"][case], rows["off"][case]
        assert on[0] == off[0], f"{case}: the cache changed the tokens"
        print(f"{case:10s} {off[1].ttft_ms:9.1f} ({off[1].cached_tokens:4d}) {on[1].ttft_ms:9.1f} ({on[1].cached_tokens:4d})")


if __name__ == "__main__":
    main()
