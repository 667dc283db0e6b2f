"""A decode's host time per token through a real store process, split as the bench splits it (issue 21).

Writes a tiny synth model (`--preset ds4-tiny` or `tiny`, the qwen3moe one), starts a `services.store_main` child
with few slots (so decode layers miss), prefills a prompt, settles the store and decodes `--tokens` greedy tokens one
at a time, then prints the median per token of: wall, host (wall less blocked), store messages, layers with a miss,
expert applications, the worker's CPU ms (getrusage), the store's CPU ms (/proc), the host ms inside the client's
store calls, and (where the checkout has it: worker/stats.py) the host split: store messages, the expert steps, the
rest, and the blocked wait for the store's expert bytes. Run it in two checkouts (PYTHONPATH=<checkout>) for an A/B.

    python3 deploy/device/decode_host.py [--preset ds4-tiny] [--vram 2 --host 3] [--tokens 64] [--device cpu]
                                         [--form default|solo|lanes] [--gate] [--profile out.prof] [--split]
                                         [--flex auto|on|off] [--host-in-place auto|always|never]
                                         [--flex-slots N] [--threads] [--sync-debug] [--group-graphs]
                                         [--calls] [--marks] [--session-reader thread|caller|spin] [--copy-early]

--preset ds4-wide: ds4-tiny's dims at ds4-flash's expert shape (8 layers x 256 experts, top-6; with --vram 49 --host 77
as its bench's auto plan): the store's work per consolidation (plan, vacate, commit: per move) at that scale.
--per-token: every decode step's row (the skipped first ones too; _token_row): host, blocked and CPU ms, the pass
open, the wait for BeginPass / EndPass replies and those messages' host ms: the spike tokens of issue 21 (a pass
boundary every decode_consolidate_every tokens: EndPass plans a consolidation, a later BeginPass applies it).

--form: the decode path. default: whatever the device takes (on the CPU: forward()'s per-layer partial path); solo /
lanes: the static form CUDA runs (forced on the CPU, eagerly: SoloDecode through forward(), or the batched lanes
through decode_batch as the engine decodes a lone sequence), with decode's at-hand group (worker/at_hand.py) and,
with --gate, decode_gate on (worker/gate.py: on the CPU each gated layer is drained where its gate stands).
--group-graphs: engine.group_graphs (worker/group_graphs.py): on CUDA a miss layer's eager groups replay a CUDA graph
per group (captured at its second sighting) instead of two launches; the expert math that miss_own_us leaves out is
then GroupGraphs.apply (a replay, a capture or the launches), and `group_graphs` counts its replays, captures and
launches over every step. In the split, moe._apply is every eager group's host us on both sides of an A/B, and
moe.kern.apply the launches alone. On the CPU it changes nothing.
--flush-early: engine.disk_flush_early (worker/moe_step.py _disk_groups): a miss layer's landed disk experts copied and
grouped as soon as the next one has not landed; disk_flushes / mean_disk_flushes count those flushes per step (each
one a group more: miss_layer_groups). With the store's test-only read jitter (BETELGEUSE_TEST_READ_JITTER=SEED:MS in
the environment: the store child inherits it) the reads land apart, as a slow disk's do (docs/benchmarks/cpu-flush57).
--copy-early: engine.disk_copy_early (worker/moe_step.py _copy_ahead): a miss layer's landed disk experts' copies
issued as soon as the next one has not landed, still ONE group after the last; disk_copies_early /
mean_disk_copies_early count those early copy calls per step (no group more: miss_layer_groups as off; docs/
benchmarks/cpu-copy65, with the read jitter as --flush-early's).
logits_sha256: every decode step's logits, hashed (first 16 hex digits): two runs of one checkout and device that
decode the same bits print the same (an A/B of a bit-neutral setting, e.g. --group-graphs, must).
--profile: cProfile of the timed decode steps only (not the setup), written to the path (pstats format).
nomiss_layer_us: the median host wall of a decode layer's expert step that had no miss (_time_layers), over
nomiss_layers such layers of the timed steps. miss_layer_us: the same step of a layer with a miss (a disk expert or
a banked host one), its wall less the pass clock's blocked waits in it (the store delivering, copies, the sync):
the host's own time, store messages included, over miss_layer_calls such layers. miss_own_us: the same less its store
messages and the expert math (kern.apply; on the CPU torch compute, on CUDA two launches a group): the step's
bookkeeping alone (tiers, guesses, banks, slot tables, staging slots, flex copies). miss_layer_groups: a miss layer's
launch groups, the mean (LayerStats.groups: the at-hand group and one per bank of misses, each but the at-hand one
two Triton launches on CUDA).
--split: the expert step's functions (SPLIT: MoEStep's, the kernels' apply, the bank copies, the session's and the
store client's messages, a Load's next expert) timed in place -> split_us {name: [median us per call, calls per
step]}; each wrapper adds ~1 us, and nested calls count in each function that encloses them.

--flex-slots N: the flex cache (worker/flex_cache.py; with --flex on or CUDA's auto) capped at N expert slots, so
fills evict copies as ds4-flash's finite room does (a tiny model's experts all fit the plan's room: no miss stays).
uploads: the at-hand table's uploads per step (AtHand.refresh: at the step's start, and after a layer whose disk
expert evicted a flex copy a later layer's table may name), median (mean_uploads: the mean); where the checkout counts
them.
--threads: per thread of the worker other than the main one (grpc's and the store client's, by name), per timed
step: its CPU us and its wakeups (voluntary + nonvoluntary context switches; services/bench/threads.py): the threads
that compete with the main one for the GIL (issue 21: the session stream's); and per step the main thread's CPU us, its
wait for a core (run queue) and main_off_us = its wall less those and the pass clock's waits: off the CPU with no wait
counted, i.e. waiting for the GIL, mostly (on CUDA; on the CPU the clock's waits hold CPU work, the bank memcpys,
so it reads low or negative there).
--calls: every call of the main thread in the timed steps, per decode layer, by part (the expert step: hand_experts /
hand_misses / partial / gate_drain; its expert math: kern.apply / GroupGraphs.apply; the rest of the step) and kind
(py: a Python function outside torch; torch: a call into torch from outside it, on CUDA each its own host work, many a
launch, an event record or a copy; c: any other C call) -> calls_per_layer (_Calls; exact, slows the run).
--marks: PassStats.gpu_marks on, as the bench's --gpu-marks (device marks: CUDA events a layer's copies, groups,
attention and routing; MoEStep.hand_fold off under them, and the solo graphs cut at each attention): what the
instrumented decode costs the host against the plain one (a device A/B of --marks off and on).
--session-reader thread|caller|spin: store.session_reader (services/grpc/store_client.py _SeqStream): the seqpacket
session stream's answers read by a reader thread or by the caller that waits for one (no thread).
--sync-debug (CUDA): torch.cuda.set_sync_debug_mode("warn") over the timed steps -> syncs {where: per step}: the
ops that block the host on the device outside the pass clock's waits (a pageable H2D copy_, .item(), ...): host time
that is really the GPU's, counted as the rest (stats.py's other_host_s).

Triton compiles (issue 21; kernels/triton_launch.py, where the checkout has it): triton_compiles = those at attach
(MoEStep.warm_kernels: decode's expert-kernel variants), in the first decode step, in the skipped steps after it, and
in the timed steps (each {"count", "seconds", "names"}, count None where not counted: the CPU's interpreter compiles
nothing), beside the first step's host ms.

On a CPU the dense part's compute is host time too: compare messages, CPU ms and the split, not host alone. With
several torch threads on a busy machine, set OMP_NUM_THREADS=1 (spinning threads swamp everything else).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _model(preset: str, tmp: Path) -> Path:
    from betelgeuse.gguf.synth import PRESETS, spec_from_preset, write_model
    path = tmp / f"{preset}.gguf"
    if preset == "tiny":       # tests/engine_helpers.py's ENGINE_SPEC: 3 layers, 32 experts, top-4
        spec = replace(PRESETS["tiny"], n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_expert=32,
                       n_expert_used=4, n_ff_exp=64, n_vocab=320, context_length=512, router_skew=0.5, seed=11,
                       qtype="Q8_0")
    elif preset == "ds4-wide":  # ds4-tiny's layers at ds4-flash's expert shape (8 layers x 256 experts, top-6): the
        spec = spec_from_preset("ds4-tiny", expert_qtype="Q8_0", seed=2)     # store's per-move work at its scale
        spec = replace(spec, n_layer=8, n_expert=256, n_expert_used=6, compress_ratios=spec.compress_ratios * 2)
    else:
        spec = spec_from_preset(preset, expert_qtype="Q8_0", seed=2)
    write_model(path, spec, progress=False)
    return path


def _time_layers(moe, a) -> tuple[list, list, list, list]:
    """(no-miss, miss, own, groups): the host seconds of each decode layer's expert step, by whether it had a miss,
    appended to the lists returned: the call after the at-hand group (MoEStep.hand_misses: the sync's wait, tier counts,
    read-ahead, scoring, the misses' loads, copies and groups; gate_drain with --gate), a layer with no miss running
    the at-hand group alone (one group: no disk expert, no banked host one), or, on the default path, MoEStep.partial
    (a miss: a disk expert). No-miss: its wall; miss: its wall less the pass clock's blocked waits (the sync, the
    store delivering, copies) in it, so store messages' host time counts and the disk's does not; own: a miss less
    its store messages and the expert math (kern.apply: CPU torch here, on CUDA asynchronous launches), i.e. the
    step's bookkeeping: tiers, guesses, banks, tables, staging slots; groups: a miss's launch groups (LayerStats.groups
    it added: the at-hand group's and one per bank of misses; on CUDA two Triton launches each but the at-hand one's,
    captured in the decode graphs). Wraps the instance's methods (either checkout's)."""
    name, at = (("gate_drain", 5) if a.gate else ("hand_misses", 4)) if a.form != "default" else ("partial", 4)
    fn, out, miss, own, groups = getattr(moe, name), [], [], [], []
    clock = moe.clock
    # the expert math's entry: with engine.group_graphs every eager group goes through its apply (replay or launch)
    math = getattr(moe, "group_graphs", None) or moe.kern
    kern_apply, in_apply = math.apply, [0.0]

    def apply(*args, **kw):                 # the expert math (CPU torch here; on CUDA two Triton launches)
        t = time.perf_counter()
        try:
            return kern_apply(*args, **kw)
        finally:
            in_apply[0] += time.perf_counter() - t

    def timed(*args, **kw):
        ls = args[at]
        g0, b0, s0, m0 = ls.groups, clock.blocked, clock.store_s, in_apply[0]
        t = time.perf_counter()
        r = fn(*args, **kw)
        dt = time.perf_counter() - t
        if ls.disk == 0 and (name == "partial" or ls.groups - g0 == 1):
            out.append(dt)
        else:
            miss.append(dt - (clock.blocked - b0))
            own.append(miss[-1] - (clock.store_s - s0) - (in_apply[0] - m0))
            groups.append(ls.groups - g0)
        return r
    setattr(moe, name, timed)
    math.apply = apply
    return out, miss, own, groups


# --split: the functions of a decode layer's expert step timed in place (owner path from the runner, method name)
SPLIT = [("moe", "hand_misses"), ("moe", "gate_drain"), ("moe", "partial"), ("moe", "_partial"), ("moe", "_hand_all"),
         ("moe", "_hand_misses"), ("moe", "_disk_groups"), ("moe", "_direct_group"), ("moe", "_disk_table"),
         ("moe", "_to_bank"),
         ("moe", "_bank_group"), ("moe", "_apply"), ("moe", "_group"), ("moe", "_release"), ("moe", "_read_in_place"),
         ("moe.kern", "apply"), ("moe.group_graphs", "apply"),
         ("moe.cache", "to_bank"), ("moe.cache", "bank_next"), ("moe.cache", "bank_copy"), ("moe.cache", "table"),
         ("moe.cache", "bank_done"), ("moe.flex", "keep"), ("moe.flex", "take"),
         ("moe.session", "load"), ("moe.session", "prefetch_start"), ("moe.session", "release"),
         ("moe.session", "flush_releases"), ("moe.guesser", "read_ahead"), ("moe.guesser", "check"),
         ("moe.guesser", "unused"), ("moe.hand", "stale"), ("moe.hand", "refresh"), ("store", "load"),
         ("store", "prefetch_start"), ("store", "release"), ("LoadStream", "__next__"), ("RoutingSync", "finish"),
         ("moe", "_send_loads"), ("moe.flex", "split"), ("moe.flex", "split_lists"), ("moe.hand", "_patch"),
         ("moe.hand", "_upload"), ("moe.guesser", "_candidates"), ("moe", "_ahead_start"), ("moe.cache", "mark")]


def _split(rn, client) -> dict:
    """Wraps SPLIT's functions the checkout has (instances where they take attributes, else their classes) ->
    {name: [seconds per call]}, filled while the timed steps run."""
    from betelgeuse.worker import moe_step, store_session
    out: dict = {}
    classes = {"LoadStream": store_session.LoadStream, "RoutingSync": moe_step.RoutingSync}
    for path, name in SPLIT:
        if path in classes:
            owner = classes[path]
        else:
            owner = client if path == "store" else rn
            for part in ([] if path == "store" else path.split(".")):
                owner = getattr(owner, part, None)
        if owner is not None and not isinstance(owner, type) and not hasattr(owner, "__dict__"):
            owner = type(owner)                  # __slots__: the class's function (the one instance uses it)
        fn = None if owner is None else (owner.__dict__.get(name) if isinstance(owner, type) else
                                         getattr(owner, name, None))
        if fn is None:
            continue
        rec = out.setdefault(f"{path}.{name}", [])

        def timed(*args, _fn=fn, _rec=rec, **kw):
            t = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                _rec.append(time.perf_counter() - t)
        setattr(owner, name, timed)
    return out


class _Calls:
    """--calls: every call the main thread makes in the timed steps (sys.setprofile), per part of a decode step: the
    expert step (`step`: MoEStep.hand_experts / hand_misses / partial / gate_drain, the host part of a layer's experts),
    its expert math inside it (`math`: kern.apply / GroupGraphs.apply: CPU torch here, Triton launches or a graph
    replay on CUDA), the rest of the step (`rest`: the dense part, graphs, the pass's bookkeeping). Kinds: `py`, a
    Python function outside torch (each comprehension one); `torch`, a call into torch from outside it (a C function
    of torch's or a tensor's / event's method, or a Python function of the torch package, counted once with what it
    calls inside torch): on CUDA each such call is host work of its own, many a launch, an event record or a copy;
    `c`, any other C call (builtins, numpy). Counting slows the run: read its timings with care; the counts are
    exact (the reader thread's calls are not counted: setprofile is per thread)."""

    ROOTS = ("hand_experts", "hand_misses", "partial", "gate_drain")
    MATH = ("apply",)

    def __init__(self, moe):
        import torch
        self._torch_dir = str(Path(torch.__file__).parent)
        self._roots = {getattr(type(moe), n).__code__ for n in self.ROOTS if hasattr(type(moe), n)}
        math = [type(moe.kern).apply]
        gg = getattr(moe, "group_graphs", None)
        if gg is not None:
            math.append(type(gg).apply)
        self._math = {f.__code__ for f in math}
        self.counts = {(p, k): 0 for p in ("step", "math", "rest") for k in ("py", "torch", "c")}
        self._part = ["rest"]                   # the part stack: a root or math call pushes, its return pops
        self._in_torch = 0                      # depth inside a torch Python function (its inner calls: not counted)
        self._torch_mods = ("torch",)

    def _is_torch_c(self, fn) -> bool:
        owner = getattr(fn, "__self__", None)
        mod = getattr(fn, "__module__", None) or type(owner).__module__ or ""
        return mod.startswith(self._torch_mods) or "_VariableFunctions" in getattr(fn, "__qualname__", "") or \
            type(owner).__module__.startswith(self._torch_mods)

    def _cb(self, frame, event, arg):
        if event == "call":
            co = frame.f_code
            if self._in_torch:
                if co.co_filename.startswith(self._torch_dir):
                    self._in_torch += 1
                return
            if co in self._roots:
                self._part.append("step")
            elif co in self._math:
                self._part.append("math")
            if co.co_filename.startswith(self._torch_dir):
                self._in_torch = 1
                self.counts[self._part[-1], "torch"] += 1
            else:
                self.counts[self._part[-1], "py"] += 1
        elif event == "return":
            co = frame.f_code
            if self._in_torch:
                if co.co_filename.startswith(self._torch_dir):
                    self._in_torch -= 1
                return
            if (co in self._roots or co in self._math) and len(self._part) > 1:
                self._part.pop()
        elif event == "c_call" and not self._in_torch:
            self.counts[self._part[-1], "torch" if self._is_torch_c(arg) else "c"] += 1

    def on(self):
        sys.setprofile(self._cb)

    def off(self):
        sys.setprofile(None)

    def per_layer(self, layers: int) -> dict:
        """{part: {kind: calls per decode layer}} over the counted steps' layers."""
        return {p: {k: round(self.counts[p, k] / max(1, layers), 2) for k in ("py", "torch", "c")}
                for p in ("step", "math", "rest")}


class _GcWatch:
    """--per-token: the cyclic collector's pauses (gc.callbacks), ms by generation since the last take(): the bench's
    decode loop does not gc.freeze() as the engine does (gc_pauses.py), so a collection may land in a timed token."""

    def __init__(self):
        import gc
        self.gc, self.t0, self.ms = gc, 0.0, {}
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.ms[g] = self.ms.get(g, 0.0) + (time.perf_counter() - self.t0) * 1e3

    def take(self) -> dict:
        out, self.ms = {g: round(v, 3) for g, v in self.ms.items()}, {}
        return out

    def close(self):
        self.gc.callbacks.remove(self._cb)


def _token_row(i: int, st, cpu_s: float) -> list:
    """--per-token: [step, host ms, blocked ms, the worker's CPU ms (all its threads: getrusage), pass-open ms
    (BeginPass and the VRAM fills), the blocked wait for BeginPass / EndPass replies ms (None: a checkout that counts
    it as host), {store message kind: [messages, host ms]}] of one decode step (its PassStats), the kinds other than
    load / release / prefetch only (the pass boundaries: begin_pass, end_pass); run() appends the step's collector
    pauses {generation: ms} (_GcWatch)."""
    msgs = {k: [n, round(s * 1e3, 3)] for k, (n, s) in getattr(st, "store_rpc", {}).items()
            if k not in ("load", "release", "prefetch", "prefetch_start")}
    reply = getattr(st, "store_reply_wait_s", None)
    return [i, round(st.host_s * 1e3, 3), round(st.blocked_s * 1e3, 3), round(cpu_s * 1e3, 3),
            round(getattr(st, "open_s", 0.0) * 1e3, 3), None if reply is None else round(reply * 1e3, 3), msgs]


class _Threads:
    """--threads: the worker's threads other than the main one, their CPU and wakeups (voluntary + nonvoluntary
    context switches) summed over the timed steps, by name (services/bench/threads.py's census: grpc's own threads
    by their kernel names); and the main thread's CPU and run-queue wait over the last step (main_off)."""

    def __init__(self):
        from services.bench import threads as census
        self.census, self.sum, self._at, self._t0, self._t1 = census, {}, {}, 0.0, 0.0
        self.main_tid = threading.main_thread().native_id
        self.last: dict = {}

    def mark(self):
        self._at, self._t0 = self.census.snapshot(), time.perf_counter()

    def add(self):
        now, self._t1 = self.census.snapshot(), time.perf_counter()
        self.last, _ = self.census.delta(self._at, now)
        for tid, c in self.last.items():
            if tid != self.main_tid:
                self.sum[tid] = c if tid not in self.sum else self.census.ThreadCount(
                    c.name, *(getattr(self.sum[tid], f) + getattr(c, f)
                              for f in ("cpu_ns", "runq_ns", "voluntary", "involuntary")))

    def main_off(self, blocked_s: float) -> dict:
        """The main thread over the last step (after add()): its CPU, its wait for a core (run queue) and the rest of
        its wall off the CPU outside the pass clock's waits (blocked_s): waits for the GIL, mostly, in us."""
        m = self.last[self.main_tid]
        cpu, runq = m.cpu_ns / 1e3, m.runq_ns / 1e3
        return dict(main_cpu_us=cpu, main_runq_us=runq, main_wakeups=m.voluntary + m.involuntary,
                    main_off_us=(self._t1 - self._t0) * 1e6 - cpu - runq - blocked_s * 1e6)

    def per_step(self, n: int) -> dict:
        return {k: {"cpu_us": v["cpu_us"], "wakeups": v["wakeups"]}
                for k, v in self.census.by_name(self.sum, n).items()}


class _sync_watch:
    """--sync-debug: torch.cuda's sync debug mode "warn" inside, each warning counted by its caller in our code."""

    def __init__(self, out: dict):
        self.out = out

    def __enter__(self):
        import warnings
        import torch
        self.torch, self.cm = torch, warnings.catch_warnings(record=True)
        self.rec = self.cm.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        self.torch.cuda.set_sync_debug_mode("default")
        self.cm.__exit__(*exc)
        for w in self.rec:
            if "synchroniz" in str(w.message):
                k = f"{Path(w.filename).name}:{w.lineno}"
                self.out[k] = self.out.get(k, 0) + 1
        return False


def run(a, tmp: Path) -> dict:
    from betelgeuse.config import EngineConfig
    from services.assembly import open_runner, open_store
    extra = dict(decode_gate="on") if a.gate else {}
    if a.group_graphs:              # a miss layer's eager groups as CUDA graph replays (worker/group_graphs.py)
        extra["group_graphs"] = True
    if a.fold:                      # the decode graphs capture each layer's routing-sync start (MoEStep.hand_fold)
        extra["decode_fold"] = True
    if a.flush_early:               # a miss layer's disk batch copied + grouped once the next expert is late
        extra["disk_flush_early"] = True
    if a.copy_early:                # a miss layer's landed disk experts copied once the next is late, one group after
        extra["disk_copy_early"] = True
    if a.flex != "auto":            # off: no flex copies of disk experts (on CUDA auto holds them: no miss remains)
        extra["flex_cache"] = a.flex == "on"
    if a.host_in_place != "auto":   # never: host experts banked, as ds4-flash's MXFP4 ones are under auto
        extra["host_in_place"] = a.host_in_place
    cfg = EngineConfig(model_path=str(_model(a.preset, tmp)), vram_slots=a.vram, host_slots=a.host, read_threads=2,
                       device=a.device, **extra)
    store = open_store(cfg, "process", str(tmp / "store"))
    client = store.client
    if a.session_reader:            # store.session_reader (before the session stream opens: its first message)
        client.session_reader = a.session_reader
    inside = [0.0]                              # host seconds inside the client's store calls
    for name in ("load", "prefetch", "prefetch_start", "release", "begin_pass", "end_pass"):
        fn = getattr(client, name)

        def timed(*args, _fn=fn, **kw):
            t = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                inside[0] += time.perf_counter() - t
        setattr(client, name, timed)
    try:
        try:
            from betelgeuse.kernels import triton_launch as TL
            TL.compile_mark
        except (ImportError, AttributeError):          # a checkout from before the compile counts (an A/B's base)
            TL = None
        if TL is not None:
            TL.watch_compiles()
            mark = TL.compile_mark()
        compiles = {}
        rn = open_runner(cfg, store)
        if TL is not None:
            compiles["attach"] = TL.compiles_since(mark)
        spid, tick = client.status()["pid"], os.sysconf("SC_CLK_TCK")
        layer_s, miss_s, own_s, groups_n = _time_layers(rn.moe, a)
        split = _split(rn, client) if a.split else None

        def store_cpu() -> float:
            f = open(f"/proc/{spid}/stat").read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / tick

        def own_cpu() -> float:
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime

        ids = [int(x) for x in np.random.default_rng(4).integers(3, rn.mcfg.n_vocab, a.prompt)]
        kv = rn.new_cache(a.prompt + a.tokens + 8)
        if a.flex_slots is not None and rn.moe.flex is not None:   # a finite room (module doc): fills evict
            f = rn.moe.flex
            f.clear()
            f.per_chunk = max(1, min(f.per_chunk, a.flex_slots))
            f.reserved = f.held + a.flex_slots * f.slot_bytes
        hand = getattr(rn.moe, "hand", None)
        threads = _Threads() if a.threads else None
        syncs: dict = {}
        lg, _ = rn.forward(ids, kv)
        rn.settle()
        tok = int(lg[-1].argmax())
        if a.form != "default":
            rn._static_decode = True            # the static form, as CUDA decodes (eagerly on the CPU)
        if a.form == "lanes":
            def step(t):
                lg, st = rn.decode_batch([t], [kv])
                return lg.reshape(-1, lg.shape[-1]), st
        else:
            def step(t):
                return rn.forward([t], kv, consolidate=False)
        prof = None
        if a.profile:
            import cProfile
            prof = cProfile.Profile()
        if a.marks:                 # the bench's --gpu-marks path: PassStats.gpu_marks (events, the fold off)
            rn.gpu_marks = True
        calls = _Calls(rn.moe) if a.calls else None
        rows, sc0, first_ms, per_token = [], None, None, []
        gcw = _GcWatch() if a.per_token else None
        logits_sha = hashlib.sha256()
        for i in range(a.tokens):
            if TL is not None and i in (0, 1, a.skip):      # the regions: first step, skipped ones, timed ones
                if i:
                    compiles["first_step" if i == 1 else "skipped_steps"] = TL.compiles_since(mark)
                mark = TL.compile_mark()
            if i == a.skip:
                sc0 = store_cpu()
                layer_s.clear()
                miss_s.clear()
                own_s.clear()
                groups_n.clear()
                for v in (split or {}).values():
                    v.clear()
                if prof is not None:
                    prof.enable()
            c0, in0 = own_cpu(), inside[0]
            u0 = getattr(hand, "uploads", 0)
            if threads is not None:
                threads.mark()
            if calls is not None and i >= a.skip:
                calls.on()
            if a.sync_debug and i >= a.skip and a.device.startswith("cuda"):
                with _sync_watch(syncs):
                    lg, st = step(tok)
            else:
                lg, st = step(tok)
            if calls is not None:
                calls.off()
            c1 = own_cpu()
            if threads is not None and i >= a.skip:
                threads.add()
            tok = int(lg[-1].argmax())
            logits_sha.update(lg.float().cpu().numpy().tobytes())      # after the step's timing: bits, not time
            if i == 0:
                first_ms = round(st.host_s * 1e3, 3)
            if a.per_token:                     # every step, the skipped ones too (issue 21: the spike tokens)
                per_token.append(_token_row(i, st, c1 - c0) + [gcw.take()])
            if i < a.skip:                      # the first steps (graph capture on CUDA)
                continue
            row = dict(wall_ms=st.seconds * 1e3, host_ms=st.host_s * 1e3, messages=st.store_calls,
                       miss_layers=sum(1 for ls in st.layers if ls.disk), applications=st.applications,
                       worker_cpu_ms=(c1 - c0) * 1e3, in_store_calls_ms=(inside[0] - in0) * 1e3)
            if threads is not None:
                row.update(threads.main_off(st.blocked_s))
            if hand is not None and hasattr(hand, "uploads"):
                row["uploads"] = hand.uploads - u0
            if hasattr(st, "disk_flushes"):     # engine.disk_flush_early's early flushes (a group more each)
                row["disk_flushes"] = st.disk_flushes
            if hasattr(st, "disk_copies_early"):    # engine.disk_copy_early's copies ahead (no group more)
                row["disk_copies_early"] = st.disk_copies_early
            if hasattr(st, "store_rpc"):
                row.update(store_messages_ms=st.store_s * 1e3, moe_host_ms=st.moe_host_s * 1e3,
                           other_host_ms=st.other_host_s * 1e3, store_wait_ms=st.store_wait_s * 1e3)
            if hasattr(st, "store_sleeps"):     # waits for the store, those the thread slept in (a wake after each)
                row.update(store_waits=st.store_waits, store_sleeps=st.store_sleeps)
            rows.append(row)
        if prof is not None:
            prof.disable()
            prof.dump_stats(a.profile)
        n = len(rows)
        out = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
        out.update(mean_messages=round(sum(r["messages"] for r in rows) / n, 2),
                   mean_wall_ms=round(sum(r["wall_ms"] for r in rows) / n, 3),
                   mean_miss_layers=round(sum(r["miss_layers"] for r in rows) / n, 2),
                   store_cpu_ms=round((store_cpu() - sc0) / n * 1e3, 2),
                   host_us_per_application=round(sum(r["host_ms"] for r in rows) / max(1, sum(
                       r["applications"] for r in rows)) * 1e3, 1),
                   nomiss_layers=len(layer_s),
                   nomiss_layer_us=round(statistics.median(layer_s) * 1e6, 1) if layer_s else None,
                   miss_layer_calls=len(miss_s),
                   miss_layer_us=round(statistics.median(miss_s) * 1e6, 1) if miss_s else None,
                   miss_own_us=round(statistics.median(own_s) * 1e6, 1) if own_s else None,
                   miss_layer_groups=round(statistics.mean(groups_n), 3) if groups_n else None)
        if "disk_flushes" in rows[0]:
            out["mean_disk_flushes"] = round(sum(r["disk_flushes"] for r in rows) / n, 2)
        if "disk_copies_early" in rows[0]:
            out["mean_disk_copies_early"] = round(sum(r["disk_copies_early"] for r in rows) / n, 2)
        if "store_sleeps" in rows[0]:
            out["mean_store_waits"] = round(sum(r["store_waits"] for r in rows) / n, 2)
            out["mean_store_sleeps"] = round(sum(r["store_sleeps"] for r in rows) / n, 2)
        if "uploads" in rows[0]:
            out["mean_uploads"] = round(sum(r["uploads"] for r in rows) / n, 2)
        if TL is not None:
            compiles["timed_steps"] = TL.compiles_since(mark)
        gg = getattr(rn.moe, "group_graphs", None)
        rn.close()
        res = {"preset": a.preset, "form": a.form + ("+gate" if a.gate else ""), "slots": f"{a.vram}+{a.host}",
               "layers": rn.mcfg.n_layer, "tokens": n, "per_token_median": out, "first_step_host_ms": first_ms,
               "logits_sha256": logits_sha.hexdigest()[:16]}
        if TL is not None:
            res["triton_compiles"] = compiles
        if a.per_token:
            gcw.close()
            res["per_token"] = per_token
        if gg is not None:       # --group-graphs on CUDA: the eager groups' replays, captures and launches (all steps)
            res["group_graphs"] = gg.stats()
        if threads is not None:  # thread name -> {cpu_us, wakeups} per timed step (means)
            res["threads"] = threads.per_step(n)
        if a.sync_debug and a.device.startswith("cuda"):     # where -> syncs per timed step (the CPU has none)
            res["syncs"] = {k: round(v / n, 2) for k, v in sorted(syncs.items(), key=lambda kv: -kv[1])}
        if calls is not None:    # part -> kind -> calls per decode layer of the timed steps (_Calls)
            res["calls_per_layer"] = calls.per_layer(n * rn.mcfg.n_layer)
        if split is not None:    # name -> [median us per call, calls per timed step]
            res["split_us"] = {k: [round(statistics.median(v) * 1e6, 1), round(len(v) / n, 2)]
                               for k, v in split.items() if v}
        return res
    finally:
        store.close()


def parser() -> argparse.ArgumentParser:
    """The command line (main's; deploy/device/sync_audit.py takes the same)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="ds4-tiny", choices=["ds4-tiny", "ds4-wide", "tiny"])
    p.add_argument("--vram", type=int, default=2)
    p.add_argument("--host", type=int, default=3)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--skip", type=int, default=3, help="first decode steps left out (graph capture)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--form", default="default", choices=["default", "solo", "lanes"],
                   help="decode path: the device's default, or the static form's solo / lanes (module doc)")
    p.add_argument("--gate", action="store_true", help="decode_gate on (with --form solo or lanes)")
    p.add_argument("--group-graphs", action="store_true",
                   help="engine.group_graphs: a miss layer's eager groups replay CUDA graphs (CUDA; the CPU: no-op)")
    p.add_argument("--fold", action="store_true",
                   help="engine.decode_fold: the decode graphs (solo, lanes) capture each at-hand layer's "
                   "routing-sync start (host57, lanesfold57)")
    p.add_argument("--flush-early", action="store_true",
                   help="engine.disk_flush_early: a miss layer's landed disk experts copied and grouped once the next "
                   "one is late (flush57)")
    p.add_argument("--copy-early", action="store_true",
                   help="engine.disk_copy_early: a miss layer's landed disk experts copied once the next one is late, "
                   "one group after the last (copy65)")
    p.add_argument("--profile", help="cProfile of the timed decode steps to this path")
    p.add_argument("--flex", default="auto", choices=["auto", "on", "off"],
                   help="the flex cache (auto: on CUDA); off keeps a decode's disk experts misses on CUDA")
    p.add_argument("--host-in-place", default="auto", choices=["auto", "always", "never"],
                   help="engine.host_in_place (never: host experts through ring banks, as ds4-flash's MXFP4 are "
                   "under auto)")
    p.add_argument("--flex-slots", type=int, help="the flex cache capped at this many expert slots (module doc)")
    p.add_argument("--threads", action="store_true", help="the worker's other threads' CPU and wakeups per step")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: the host-blocking ops of the timed steps, by where (module doc)")
    p.add_argument("--per-token", action="store_true",
                   help="every decode step's host / blocked / CPU / pass-open ms and its pass-boundary messages")
    p.add_argument("--session-reader", choices=["thread", "caller", "spin"],
                   help="store.session_reader: who reads the seqpacket session stream's answers (default: the "
                   "setting's; a checkout without it ignores this)")
    p.add_argument("--calls", action="store_true",
                   help="calls per decode layer by part (expert step, its math, the rest) and kind (py, torch, c)")
    p.add_argument("--marks", action="store_true",
                   help="PassStats.gpu_marks on (the bench's --gpu-marks: device marks, which turn the fold off)")
    p.add_argument("--split", action="store_true",
                   help="the expert step's functions timed in place: median us per call, calls per step (SPLIT)")
    return p


def main() -> int:
    a = parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="bg-decode-host-") as d:
        print(json.dumps(run(a, Path(d))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
