#!/usr/bin/env python3
"""Decode's at-hand group, where it reads host-tier experts, and the device gate, side by side: step times, bytes over
PCIe, the gate's diagnostics and bits, per lanes count; each setting in its own process.

    python3 deploy/device/check_gate.py [MODEL.gguf] [--device cuda] [--slots 16+35] [--settings off,always,never,auto]
                                         [--lanes 1,4,8] [--prompt 64] [--decode 16] [--solo 8] [--timeout 150]
    python3 deploy/device/check_gate.py --settings off,always,gate,gate-eager --lanes 1,4      # the device gate

Settings (each a fresh store and runner IN ITS OWN PROCESS: one that fails or hangs does not hide the next, --timeout
seconds each; real O_DIRECT reads, the flex cache at its default):
    off      decode_at_hand false: the partial path per layer (the reference for the bits)
    always   the at-hand group, host slots read in place over PCIe by the kernels (engine.host_in_place = always;
             alias "on")
    never    the at-hand group for VRAM and flex experts, host experts copied into ring banks (host_in_place = never;
             alias "banked")
    auto     host_in_place = auto: in place for steps of at most at_hand.IN_PLACE_MAX_ROWS rows, banked above
    gate     always + decode_gate on (worker/gate.py: armed only for replayed parts, opened by the host alone, the misses
             read in place by a group after the gate on the same stream; gpu-run35 gave up on a first, eager step,
             gpu-run38 on a replayed one whose gate waited for a side stream's kernels)
    gate-eager    gate with CUDA_MODULE_LOADING=EAGER (every CUDA module loaded at start, none while a gate spins)
  diagnostic A/Bs (reported, not in the verdict):
    gate-nofence  gate without the kernels' system fences (BETELGEUSE_GATE_FENCE=0): does the marker reach the host
                  while its gate spins without them?
    gate-ahead    the old rule: every gate armed, nothing drained before an eager launch; expected to fail on its
                  first step if a host block under a spinning gate was the bug (meaningless on the CPU, which cannot
                  defer a drain: its bits differ there)
    gate-conn     gate with CUDA_DEVICE_MAX_CONNECTIONS=32 (default 8): the side-stream gate of gpu-run38 waited for
                  another stream's kernels, which CUDA runs beside it only where the two streams do not share a
                  hardware work queue; the gate no longer waits for any stream, so this should change nothing
For each lanes count n (1, 4, 8 sequences decoded together: decode_batch, the engine's form) n prompts are prefilled and
decoded `decode` steps twice: round 0 "cold" (the prompts' experts partly on disk), round 1 "warm" (the same prompts
again: their experts at hand, the prompt from the prefix cache); then `solo` tokens through forward() (the solo decode
graphs). Prints per lanes count and setting: the mean step time of each round's second half, and per step the bytes
over PCIe: read in place by the kernels (PassStats.in_place_bytes: each host expert's slot once per row block of the
kernel, i.e. once for <= 16 rows) + copied by the copy engine (h2d_bytes: ring banks, flex copies, VRAM fills) and
the disk's. For a gated setting: how many steps ran ahead (armed gates: replayed parts) or drained each layer at once
(disarmed: eager / captured parts), the most loads a gate spun, and the Triton kernels compiled and flex cache chunks
allocated while an armed drain ran (a module load or cudaMalloc there may wait for the spinning GPU); on a failure
the phase and step (eager / capture / replay), its wall time and the gate's report (the layers that gave up, the
host's drain position and marker waits by layer, flags, markers, spin counts). Then whether every logit of each
setting is the bits of "off", and one line `verdict: PASS ...` or `verdict: FAIL (...)`; exit status 1 on FAIL.

MODEL defaults to /var/tmp/g/b16.gguf, written first where missing (the bench preset at 16 layers, Q8_0, 32 GB / 3 =
~10.8 GB: gpu-run35's model). Expected on the H200: every "bit-identical"; lanes 1: always (in place) at or below
never; lanes 4 and 8: the question this answers, "in place" against "banked" (the auto rule's IN_PLACE_MAX_ROWS
follows the crossover); gate and gate-eager with no failure and faster than always once warm (target: near the GPU's
work when nothing is missed). Runs in < 3 minutes with the model written (about 1 without) for four settings.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # first: puts this checkout on sys.path

MB = 1e6
DEFAULT_MODEL = "/var/tmp/g/b16.gguf"
SETTINGS = {"off": "always", "always": "always", "never": "never", "auto": "auto", "gate": "always",
            "gate-eager": "always", "gate-nofence": "always", "gate-ahead": "always", "gate-conn": "always"}
ALIASES = {"on": "always", "banked": "never"}
DIAGNOSTIC = ("gate-nofence", "gate-ahead", "gate-conn")
ENV = {"gate-eager": {"CUDA_MODULE_LOADING": "EAGER"}, "gate-nofence": {"BETELGEUSE_GATE_FENCE": "0"},
       "gate-conn": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}}


def _kind(step: int) -> str:
    """Graphs of a key (a lanes count's lane parts, a sequence's attention): eager, captured, then replayed."""
    return ("eager", "capture")[step] if step < 2 else "replay"


class _Watch:
    """Gated settings: per step, whether its gated layers ran armed / disarmed (DecodeGate.pos), the most loads a gate
    spun, the Triton kernels compiled and flex chunks allocated while an armed drain ran."""

    def __init__(self, rn):
        self.gate = rn.moe.gate
        self.steps = {"armed": 0, "disarmed": 0, "mixed": 0, "ungated": 0}
        self.max_spins, self.compiles, self.flex_grows, self.in_armed = 0, [], 0, False
        if self.gate is None:
            return
        moe, drain = rn.moe, rn.moe.gate_drain

        def watched(*args, armed=True, **kw):
            self.in_armed = armed
            try:
                return drain(*args, armed=armed, **kw)
            finally:
                self.in_armed = False
        moe.gate_drain = watched
        flex = getattr(rn, "flex", None)
        if flex is not None:
            grow = flex._grow

            def watched_grow():
                grew = grow()
                self.flex_grows += bool(grew and self.in_armed)
                return grew
            flex._grow = watched_grow
        try:
            import triton

            def hook(*_, **kw):
                if self.in_armed:
                    self.compiles.append(str(kw.get("repr", "?"))[:160])
            triton.knobs.runtime.jit_post_compile_hook = hook
        except (ImportError, AttributeError):
            self.compiles = None                # this Triton has no such hook: not measured

    def after_step(self):
        if self.gate is None:
            return
        p = self.gate.pos
        kind = "mixed" if p.armed and p.disarmed else "armed" if p.armed else "disarmed" if p.disarmed else "ungated"
        self.steps[kind] += 1
        if self.gate.cuda:
            self.max_spins = max(self.max_spins, int(self.gate.spins.max().item()))

    def summary(self) -> dict:
        return {"steps": self.steps, "max_spins": self.max_spins, "compiles": self.compiles,
                "flex_grows": self.flex_grows}


def one(a, setting: str, lanes: list[int]) -> dict:
    """One setting in this process -> {"logits": {(n, round): [steps, n, V]} + "solo", "rows": {(n, round): row},
    "in_place": per n, "watch", "failure": where it failed or None}."""
    import numpy as np
    import torch

    from betelgeuse.assembly import open_runner, open_store
    from betelgeuse.config import EngineConfig
    from betelgeuse.errors import BetelgeuseError
    from betelgeuse.worker.gate import DecodeGate

    gated = setting.startswith("gate")
    DecodeGate.MAX_ITER = a.max_iter
    if setting == "gate-ahead":             # the old rule (diagnostic): armed everywhere, nothing drained early
        from betelgeuse.worker.lanes import Lanes
        Lanes.replays = lambda self, name, l, kvs: True
        Lanes._host = lambda self: None
    vram, host = _common.slot_pair(a.slots)
    cfg = EngineConfig(model_path=a.model, device=a.device, vram_slots=vram, host_slots=host,
                       max_running=max(lanes), decode_at_hand=setting != "off", host_in_place=SETTINGS[setting],
                       decode_gate="on" if gated else "off")
    store = open_store(cfg)
    rn = open_runner(cfg, store)
    cuda = rn.device.type == "cuda"
    if not cuda:
        rn._static_decode = True        # the CPU (a check of this script): the lanes, as on CUDA (the tests do the same)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    V = rn.mcfg.n_vocab
    watch = _Watch(rn)
    res = {"logits": {}, "rows": {}, "in_place": {}, "failure": None,
           "module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)")}
    where = {"phase": "start", "step": 0, "kind": "eager", "t": time.perf_counter()}

    def mark(phase, step, kind):
        where.update(phase=phase, step=step, kind=kind, t=time.perf_counter())
    try:
        for n in lanes:
            rng = np.random.default_rng(a.seed + n)           # the same prompts for every setting
            prompts = [[int(x) for x in rng.integers(3, V, a.prompt)] for _ in range(n)]
            for r in range(2):
                kvs = [rn.new_cache(a.prompt + a.decode + 8) for _ in range(n)]
                mark(f"lanes {n} round {r} prefill", 0, "eager")
                toks = [int(rn.forward(p, kv)[0][-1].argmax()) for p, kv in zip(prompts, kvs)]
                times, inb, h2d, disk, out = [], [], [], [], []
                for i in range(a.decode):
                    # this lanes count's lane graphs go on from round 0; the new sequences' attention starts eager
                    mark(f"lanes {n} round {r}", i, f"lane parts {_kind(i + r * a.decode)}, attention {_kind(i)}")
                    sync()
                    t = time.perf_counter()
                    lg, st = rn.decode_batch(toks, kvs)
                    sync()
                    times.append(time.perf_counter() - t)
                    watch.after_step()
                    inb.append(st.in_place_bytes)
                    h2d.append(st.h2d_bytes)
                    disk.append(st.disk_bytes)
                    out.append(lg.float().cpu())
                    toks = [int(x) for x in lg.argmax(-1)]
                for j, kv in enumerate(kvs):
                    rn.request_done(kv, others_running=j + 1 < n)
                h = len(times) // 2
                res["rows"][n, r] = (1e3 * float(np.mean(times[h:])), np.mean(inb) / MB, np.mean(h2d) / MB,
                                     np.mean(disk) / MB)
                res["logits"][n, r] = torch.stack(out)
            res["in_place"][n] = rn.moe.hand is not None and rn.moe.hand.in_place
        # solo: forward() of one token (the solo decode graphs)
        ids = [int(x) for x in np.random.default_rng(a.seed).integers(3, V, a.prompt)]
        kv = rn.new_cache(a.prompt + a.solo + 8)
        mark("solo prefill", 0, "eager")
        lg, _ = rn.forward(ids, kv, consolidate=False)
        solo = []
        for i in range(a.solo):
            mark("solo (forward of one token)", i, _kind(i))
            lg, _ = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            watch.after_step()
            solo.append(lg[-1:].float().cpu())
        rn.request_done(kv, others_running=False)
        res["logits"]["solo"] = torch.cat(solo)
    except BetelgeuseError as e:
        res["failure"] = {"phase": where["phase"], "step": where["step"], "kind": where["kind"],
                          "step_wall_s": round(time.perf_counter() - where["t"], 3), "error": str(e)}
    finally:
        res["watch"] = watch.summary() if gated else None
        rn.close()
        store.close()
    return res


def child(a, lanes: list[int]) -> int:
    import torch
    t = time.perf_counter()
    res = one(a, a.one, lanes)
    res["wall_s"] = time.perf_counter() - t
    torch.save(res, a.out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(ap, slots="16+35", slots_help="VRAM+host slots per layer (the serve plan's, bench geometry)",
                           model_optional=True)
    for flag, n in (("--prompt", 64), ("--decode", 16), ("--solo", 8), ("--seed", 7), ("--timeout", 150),
                    ("--max-iter", 1 << 24)):
        ap.add_argument(flag, type=int, default=n)
    ap.add_argument("--settings", default="off,always,never,auto",
                    help=f"comma-separated, off first: {', '.join(SETTINGS)} (aliases on = always, banked = never)")
    ap.add_argument("--lanes", default="1,4,8", help="comma-separated: sequences decoded together")
    ap.add_argument("--banked", action="store_true", help="(kept for old commands: never is in the default list)")
    ap.add_argument("--one", help=argparse.SUPPRESS)       # the child: one setting, its results to --out
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    names = [ALIASES.get(s.strip(), s.strip()) for s in a.settings.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    lanes = [int(x) for x in a.lanes.split(",") if x.strip().isdigit()]
    if bad or not names or names[0] != "off" or not lanes or min(lanes) < 1 or len(lanes) != len(a.lanes.split(",")):
        ap.error(f"--settings {a.settings!r} (off first, then of {', '.join([*SETTINGS, *ALIASES])}) or --lanes "
                 f"{a.lanes!r} (positive integers)")
    if a.one:
        return child(a, lanes)
    t0 = time.perf_counter()
    if a.model is None:
        from betelgeuse.gguf.synth import spec_from_preset
        a.model = str(_common.synth_if_missing(DEFAULT_MODEL, spec_from_preset("bench", n_layer=16),
                                               say="wrote {path} in {secs:.0f} s"))
    import torch
    res, broken = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for s in dict.fromkeys(names):
            out = str(Path(tmp) / f"{s}.pt")
            argv = [sys.executable, __file__, a.model, "--one", s, "--out", out, "--device", a.device, "--slots",
                    a.slots, "--lanes", a.lanes, "--settings", a.settings] + [
                x for f in ("prompt", "decode", "solo", "seed", "max_iter") for x in (f"--{f.replace('_', '-')}",
                                                                                      str(getattr(a, f)))]
            t = time.perf_counter()
            try:
                p = subprocess.run(argv, env=dict(os.environ, **ENV.get(s, {})), capture_output=True, text=True,
                                   timeout=a.timeout)
                rc, err = p.returncode, p.stderr
            except subprocess.TimeoutExpired as e:
                rc, err = f"timeout ({a.timeout} s)", e.stderr.decode(errors="replace") if isinstance(
                    e.stderr, bytes) else (e.stderr or "")
            if rc != 0 or not Path(out).exists():
                print(f"{s}: its process ended with {rc} after {time.perf_counter() - t:.0f} s; the end of its "
                      "stderr:\n    " + "\n    ".join(err.strip().splitlines()[-25:]), flush=True)
                if s not in DIAGNOSTIC:
                    broken.append(f"{s} ended with {rc}")
                continue
            res[s] = torch.load(out, weights_only=False)
            print(f"{s}: {res[s]['wall_s']:.0f} s in its process (CUDA_MODULE_LOADING {res[s]['module_loading']})",
                  flush=True)
    print(f"{len(res)} settings in {time.perf_counter() - t0:.0f} s; per step: ms = mean of each round's second half, "
          f"PCIe MB = read in place + copied (h2d), disk MB")
    for n in lanes:
        print(f"lanes {n}:")
        for s, r in res.items():
            cells = []
            for rd, name in ((0, "cold"), (1, "warm")):
                if (n, rd) not in r["rows"]:
                    cells.append(f"{name} -")
                    continue
                ms, inb, h2d, disk = r["rows"][n, rd]
                cells.append(f"{name} {ms:7.2f} ms, PCIe {inb:6.1f} + {h2d:6.1f} = {inb + h2d:6.1f} MB, disk "
                             f"{disk:6.1f} MB")
            print(f"  {s:12s} host in place: {str(r['in_place'].get(n, '-')):5s} | " + " | ".join(cells))
    ok = not broken
    bad = list(broken)
    for s, r in res.items():
        diag = s in DIAGNOSTIC
        w, f = r["watch"], r["failure"]
        if w is not None:
            c = w["compiles"]
            print(f"{s}: gated steps {w['steps']} (armed = ran ahead); most loads a gate spun: {w['max_spins']}; "
                  f"Triton compiles in armed drains: {'not measured' if c is None else len(c)}"
                  f"{'' if not c else ' ' + repr(c[:4])}; flex chunks allocated in armed drains: {w['flex_grows']}")
        if f is not None:
            print(f"{s}: FAILED in {f['phase']}, step {f['step']} ({f['kind']}), after {f['step_wall_s']} s:\n    "
                  f"{f['error']}")
            if not diag:
                ok = False
                bad.append(f"{s} failed")
        if s == "off" or "off" not in res:
            continue
        differ = []
        for k, x in res["off"]["logits"].items():
            y = r["logits"].get(k)
            name = "solo" if k == "solo" else f"lanes {k[0]} round {k[1]}"
            if y is None:
                differ.append(f"{name} (not run)")
            elif not torch.equal(x, y):
                differ.append(f"{name} (max |diff| {(x - y).abs().max().item():.3e})")
        if differ and not diag:
            ok = False
            bad.append(f"{s} differs")
        print(f"logits {s} == off{' (diagnostic, not in the verdict)' if diag else ''}:",
              "DIFFER in " + ", ".join(differ) if differ else f"bit-identical (lanes {a.lanes}, both rounds, solo)")
    print(f"total {time.perf_counter() - t0:.0f} s")
    print("verdict:", "PASS (every logit bit-identical, no gate failed)" if ok else f"FAIL ({'; '.join(bad)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
