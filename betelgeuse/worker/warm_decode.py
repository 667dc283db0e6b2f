"""Decode's dense kernels compiled at attach (issue 21), not in the first timed decode token.

A fresh device's first decode token took 1.3-1.65 s of host (gpu-run29/38/42/44): Triton compiles each kernel
variant at its first launch, and a variant is keyed by the launch's constexprs and each runtime argument's
specialization (an int == 1, a multiple of 16, an address 16-byte aligned: kernels/triton_launch.py). The expert
kernels' decode variants are compiled at attach by MoEStep.warm_kernels; this does the rest of a decode step: the
model's dense decode (deepseek4's TritonOps: hc_*, rms_rope, compress_step, index_topk, decode_attend, the router,
the guess; qwen3moe's norms), the runner's router (MoEStep.route_static) and the expert routing (kernels.moe.route),
in each form the runner decodes in:

    solo    one token through SoloDecode's sequence of model calls (worker/decode_graphs.py _ops): embed,
            attention_block(static=True), moe_input, route_static, kern.route, guess_ahead (every layer where the
            runner guesses), moe_output with the routed part = zeros, logits; once per state length of WARM_LENGTHS
    lanes   the batched lanes (worker/lanes.py, B = max_running lanes) over n = 1 .. B scratch sequences in lanes
            0 .. n-1 (the lanes a fresh attachment hands out first: a one-row view's address alignment follows its
            lane), and a lone sequence of each other length; the expert step between layers is skipped (its kernels
            are warm_kernels'), the combine is a no-op (the routed rows stay zeros)

on SCRATCH states (model.new_cache, never the kv manager's: no uid a sequence holds, no flex hold) that fit the
plan's KV reservation the live sequences leave free (at attach the flex cache holds no chunk yet: ModelRunner.attach
makes it just before), freed after, with the caching allocator's free blocks given back on CUDA. Nothing the passes
read is touched: no store message, no pass open, no expert slot, table, directory, counts or stats, no prefix cache,
no graph captured (a scratch Lanes and no SoloDecode entry), the RoPE memo reset. The scratch states' positions stay
0 (begin_static, never committed): a static step's kernels take the position in a device tensor, so it is not in
any compile key.

State lengths: a deepseek4 state's compressed-entry count (ceil(max_len / ratio)) is a kernel int argument (the
indexer's N, decode_attend's NE), so its specialization class (== 1, a multiple of 16, neither) is in the key.
WARM_LENGTHS give each class for ratio 128 (1, 2, 16 entries) and ratio 4 (32, 34, 64, 512: the "neither" class at
136, the bench's prompt 64 + decode 64 + 8 state); the kv manager's states are multiples of 256 tokens or max_context.
A length the warm-up did not see may still compile in the first token of a state of another class; so may an
approximate routing variant the host refreshes later (warm_routes compiles its selection), and decode_gate's kernels
(worker/gate.py: off by default; not warmed here).

deepseek41 with Engram tables is not warmed: a static step's Engram rows are staged from the store
(Deepseek41Model.engram_stage through worker/engram_feed.py), and a warm-up sends no store message.
"""

from __future__ import annotations

import logging
import time

import torch

from betelgeuse.logs import event
from betelgeuse.model.registry import arch_of
from betelgeuse.worker.guess import guess_ahead
from betelgeuse.worker.lanes import Lanes

log = logging.getLogger("betelgeuse.worker")

# tokens: the scratch states' lengths (module doc: each specialization class of the compressed-entry counts)
WARM_LENGTHS = (128, 136, 256, 2048)


def warm_decode(runner, force: bool = False) -> dict | None:
    """At attach, on CUDA in the static form (force: anywhere, the tests): the dense decode kernels' variants run
    once on scratch states (module doc) -> {"seconds", "compiles": kernels/triton_launch.compiles_since, "solo":
    lengths, "lanes": the n run, "state_bytes": the scratch peak} or {"skipped": why}; None where decode does not
    run in the static form (the CPU unless forced, a model without it)."""
    m, moe, cfg = runner.model, runner.moe, runner.cfg
    if not m.static_decode or not (runner._static_decode or force):
        return None
    if runner.session.engram is not None:
        return _skip("Engram rows are staged from the store (deepseek41)")
    from betelgeuse.kernels import triton_launch as TL
    TL.watch_compiles()
    mark, t0 = TL.compile_mark(), time.perf_counter()
    # the plan's KV reservation the live sequences (carried over a re-attach) leave free: the scratch states' room.
    # Negative where the live states the runner counts hold more than the reservation: states made by new_cache and
    # never released (ModelRunner.release) stay counted, with their decode graphs' bytes (the bench harness made one
    # per pass and released none before session 14: -99 MB at its second case's re-attach)
    reserved, live = runner._kv_reserved(), runner.kv_bytes
    free = reserved - live
    elt = torch.empty((), dtype=runner.dtype).element_size()
    arch = arch_of(runner.mcfg)

    def size(n: int) -> int:
        return arch.state_bytes(runner.mcfg, n, elt)
    lengths = sorted({max(1, min(n, cfg.max_context)) for n in WARM_LENGTHS})
    lengths = [n for n in lengths if size(n) <= free]
    if not lengths:
        return _skip(f"a scratch state of {min(WARM_LENGTHS)} tokens ({size(min(WARM_LENGTHS))} B) does not fit "
                     f"the free KV reservation ({free} B: {len(runner._kv_live)} live states hold {live} B of "
                     f"{reserved} B)")
    B = max(1, int(cfg.max_running))
    n_lanes = min(B, free // size(lengths[0])) if m.lane_decode else 0
    ids = torch.zeros(1, dtype=torch.int64, device=runner.device)      # token 0 (any id: the kernels' keys are shapes)
    try:
        with torch.no_grad():
            for n in lengths:
                kv = m.new_cache(n)
                _solo(m, moe, kv, ids)
                del kv
            if n_lanes:
                _lanes(runner, lengths, n_lanes, B)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    finally:
        rope = getattr(m, "rope", None)
        if rope is not None:
            rope.reset()                    # the memo holds the scratch positions; the next pass starts its own
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()        # the scratch states' blocks back: the plan's VRAM is as before
    peak = max(size(lengths[-1]), n_lanes * size(lengths[0]))
    out = {"seconds": time.perf_counter() - t0, "compiles": TL.compiles_since(mark), "solo": lengths,
           "lanes": n_lanes, "state_bytes": peak}
    if n_lanes < B and m.lane_decode:
        out["lanes_short"] = f"{B} lanes, room for {n_lanes} scratch states"
    event(log, "warm_decode", logging.INFO, seconds=round(out["seconds"], 3), compiles=out["compiles"].get("count"),
          lengths=lengths, lanes=n_lanes, state_bytes=peak)
    return out


def _skip(why: str) -> dict:
    event(log, "warm_decode", logging.INFO, skipped=why)
    return {"skipped": why}


def _solo(m, moe, kv, ids):
    """One static token of a scratch state: SoloDecode._ops' model calls, no expert work (module doc)."""
    pos = kv.begin_static()
    x = m.embed(ids)
    for l in range(moe.n_layer):
        x = m.attention_block(l, x, kv, pos, static=True)
        h, aux = m.moe_input(l, x)
        top_ids, top_w = moe.route_static(m, l, h, ids)
        moe.kern.route(h, top_ids, top_w)                       # kernels.moe.route: no count kept
        guess_ahead(m, l, x, ids, moe.depth, moe.n_layer)       # the layers the runner guesses at (any residency)
        x = m.moe_output(l, x, aux, h, torch.zeros((1, h.shape[-1]), dtype=h.dtype, device=h.device))
    m.logits(x)


def _lanes(runner, lengths: list[int], n_lanes: int, B: int):
    """The batched lanes' steps over scratch states: n = 1 .. n_lanes sequences in lanes 0 .. n-1 (the shortest
    length), then a lone sequence of each other length in lane 0 (module doc)."""
    m, moe = runner.model, runner.moe
    ln = Lanes(m, runner.mcfg.n_layer, B, False, guess=moe.depth, router=moe.route_static)
    variant = moe.static_variant()

    def route(l, h, ids, w):
        return moe.kern.route(h, ids, w)                        # not MoEStep.route_rows: no count kept

    def combine(r, out=None, rows=None):                        # no expert work: the routed rows stay zeros
        return out

    def step(kvs):
        idx = ln.join(kvs)
        for kv in kvs:
            kv.begin_static()
        ids = torch.zeros(len(kvs), dtype=torch.int64, device=runner.device)
        ln.begin(ids, kvs, idx, variant)
        for l in range(runner.mcfg.n_layer):
            ln.front(l, kvs, route, combine)
        ln.head(kvs, combine)
        for kv in kvs:
            ln.leave(kv.uid)
    kvs = [m.new_cache(lengths[0]) for _ in range(n_lanes)]
    for n in range(1, n_lanes + 1):
        step(kvs[:n])
    del kvs
    for n in lengths[1:]:
        step([m.new_cache(n)])
