#!/usr/bin/env python3
"""Copy ahead in pool-routed decode (issue 21, helper pool48): the same greedy decode with engine.prefetch_host off
and on, in the static decode form (forced on the CPU, as CUDA decodes), host experts banked (host_in_place never:
MXFP4's rule on the device) -> per slot configuration: tokens, host-tier reads, host experts copied ahead and of them
used (hits), H2D bytes a token off / on, whether the logits are the same bits, and, from a log of the step's events,
how many routed host experts were computed from a slot copied BEFORE their layer's routing reached the host (the
copies ahead that did their job) off / on, and the expert step's host µs per application. Counts and order: on the
CPU a copy is a synchronous memcpy and the kernels are torch's, so no time figure here says anything about the
device (the host µs included).

    PYTHONPATH=. python3 docs/benchmarks/cpu-pool48/copy_ahead.py [--experts 64 --k 6 --slots 8+24 16+32 --steps 32]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from copy_ahead_log import ahead_reads, watch  # noqa: E402
from engine_helpers import close_runner, in_process_runner, prompt  # noqa: E402


def run(path, vram: int, host: int, on: bool, steps: int, device: str) -> dict:
    rn, st = in_process_runner(path, vram, host, routing="pool", prefetch_host="on" if on else "off",
                               host_in_place="never", decode_consolidate_every=0, device=device)
    try:
        kv = rn.new_cache(64 + steps + 8)
        lg, _ = rn.forward(prompt(64, rn.mcfg.n_vocab, seed=5), kv)
        rn.settle()
        rn._static_decode = True
        log: list = []
        watch(rn, log)
        outs, tot = [], {"host_guessed": 0, "host_guess_hits": 0, "h2d_bytes": 0, "host": 0, "vram": 0, "disk": 0,
                         "moe_host_s": 0.0, "applications": 0}
        for _ in range(steps):
            log.append(("step",))
            lg, s = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            outs.append(lg[-1:].float().cpu())
            for k in ("host_guessed", "host_guess_hits", "h2d_bytes", "moe_host_s", "applications"):
                tot[k] += getattr(s, k)
            for k in ("host", "vram", "disk"):
                tot[k] += s.reads[k]
        tot["ahead_reads"] = ahead_reads(log)
        # banked host experts routed by a layer with a layer before it in the step (the first has no guess)
        tot["coverable"] = sum(len(ev[2]) for ev in log if ev[0] == "route" and ev[1] > 0)
        return {"logits": torch.cat(outs), **tot}
    finally:
        close_runner(rn, st)


def us(r: dict) -> float:
    """The decode's expert-step host time per expert application (PassStats.moe_host_s), µs: CPU Python only."""
    return r["moe_host_s"] / max(1, r["applications"]) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ds4-tiny")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--slots", nargs="+", default=["8+24", "16+32"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        spec = replace(spec_from_preset(a.preset), n_expert=a.experts, n_expert_used=a.k)
        write_model(path, spec, progress=False)
        print("| slots V+H | tokens | host reads (of them at layers >= 1) | copied ahead | hits (rate) | H2D MB / "
              "token off / on | bits equal | routed host experts read from a slot copied before their routing, "
              "off / on | expert step host µs / application off / on (CPU) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for sl in a.slots:
            v, h = (int(x) for x in sl.split("+"))
            off, on = (run(path, v, h, x, a.steps, a.device) for x in (False, True))
            same = torch.equal(off["logits"], on["logits"])
            rate = on["host_guess_hits"] / on["host_guessed"] if on["host_guessed"] else 0.0
            print(f"| {sl} | {a.steps} | {on['host']} ({on['coverable']}) | {on['host_guessed']} | "
                  f"{on['host_guess_hits']} ({rate:.1%}) | {off['h2d_bytes'] / a.steps / 1e6:.3f} / "
                  f"{on['h2d_bytes'] / a.steps / 1e6:.3f} | {same} | {off['ahead_reads']} / {on['ahead_reads']} | "
                  f"{us(off):.1f} / {us(on):.1f} |")
            print(json.dumps({"slots": sl, "off": {k: v for k, v in off.items() if k != "logits"},
                              "on": {k: v for k, v in on.items() if k != "logits"}, "bits_equal": same}),
                  file=sys.stderr)


if __name__ == "__main__":
    main()
