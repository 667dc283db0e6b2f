#!/usr/bin/env python3
"""The engine's checks on the GPU machine (no pytest there: plain asserts, a printed table).

    python deploy/device/check_cuda.py                 # device=cuda; OUT=/dir writes check_cuda.{md,json}
    python deploy/device/check_cuda.py --device cpu    # the same checks on the CPU (no pinned check)

1. invariance: layer-major logits bit-identical across slot configs (0/0, 0/all, 5/15, all in VRAM),
   cold / warm / after consolidation, in-process store and the real store process; the reference
   model on the same device+dtype must match bit for bit; vs the CPU float32 reference: max-abs diff
   and whether greedy tokens (argmax per position) match.
2. pinned: the worker registered the arena (runner.cache.pinned, tensor.is_pinned()) and a copy from
   it runs at pinned speed (GB/s of a 256 MiB copy: arena view vs a pageable tensor).
3. overlap: torch.profiler trace of one layer-major prefill (mid model, 5/15, warm and cold): the
   fraction of host->device memcpy time that overlaps compute kernels on another stream.
4. batch: batched decode with per-sequence CUDA graphs (eager, captured, replayed) == each sequence alone; pool
   routing's decode (tiny, 2+4 of 16 slots) eager == graph replay bit for bit, solo and lanes.
4b. recycle: a second sequence on the first one's recycled state (runner.new_cache; issue 21) captures no decode
   graph (it replays from its first step) and its logits equal a fresh runner's bit for bit, solo and lanes (tiny).
5. PP tok/s layer-major vs standard on the tiny and the mid model, same slot config and state.
6. kernels: every expert type the kernels read (Q8_0, MXFP4, the K- and i-quants) at the bench geometry, through
   deploy/device/kernel_roofline.check (vs the torch path in bf16, row invariance, the in-kernel weights), the decode
   schedule's rows a program (kernel_roofline.check_rows: one row's bits at BM_MV 1, 8, 16); act_quant bf16's
   schedule (triton_mmq's bf16 MMA, Q8_0 / MXFP4 / Q4_K / Q5_K: kernel_roofline.bf16_check: vs the torch path beside the
   float path's error, a row alone == in the 16-row launch, word loads == byte loads); and a
   Q4_K_M model (Q4_K experts, Q6_K/Q8_0 attention) through the runner: logits bit-identical across slot
   configurations, passes and decode steps, and equal to the reference model on the device.

CHECK_GROUP_GRAPHS=1 / CHECK_ACT_QUANT=bf16 (environment): every check's engine with engine.group_graphs on / with
engine.act_quant so (check_ds4.py's engines too): the invariance and batch rows then hold those paths to the same bits.
CHECK_PACK_EXPERTS=1 (with CHECK_ACT_QUANT=bf16 or auto): every check's engine with engine.pack_experts on (its VRAM
slots' Q8_0 experts in mma_pack's layout, read by gluon_mmq's PK 2; host slots and the ring GGUF), the tiny model's
experts 64 wide (whole tiles): the invariance rows (0/0, 0/all, 5/15, all in VRAM, cold / warm, the reference) then
hold a packed VRAM expert to a GGUF one's bits, and the batch, pool and recycle rows the decode paths.
CHECK_QTYPE=Q4_K (with CHECK_ACT_QUANT=bf16 and CHECK_PACK_EXPERTS=1: cpu-packk62): the tiny model written with Q4_K
tensors, 256 wide (hidden and experts: whole Q4_K super-blocks and 64-row tiles), so the packed experts are Q4_K.
CHECK_TILE_EXPERTS=1 (act_quant off, the default; cpu-tile63): every check's engine with engine.tile_experts on (its
VRAM slots' Q8_0 / Q4_K experts in tile_layout's 64-row tiles, read by triton_moe's `tiled` float kernels; host slots,
staging, flex and the ring GGUF), the tiny model's experts 64 wide (whole tiles; with CHECK_QTYPE=Q4_K hidden and
experts 512 wide: two super-blocks a row, so the tiles move them): the invariance rows then hold a tiled VRAM expert
to a GGUF one's bits, and the batch, pool and recycle rows the decode paths. With either, the row "invariance: VRAM
experts relaid" fails unless every VRAM expert of each config was held relaid (bit 0 of its base; on the CPU's torch
kernels nothing is, so it fails there: the checks would hold nothing).

--adversarial-timing SEED:MS runs them all with the store's test-only jitter (store/reader.py Jitter: every expert
read held back up to MS ms, staged copies handed out shuffled, consolidation fills slowed), in-process stores and
the store process alike: the invariance rows must still be bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from betelgeuse.config import EngineConfig  # noqa: E402
from betelgeuse.errors import BetelgeuseError  # noqa: E402
from betelgeuse.gguf.reader import GGUFModelFile  # noqa: E402
from betelgeuse.gguf.synth import PRESETS, write_model  # noqa: E402
from betelgeuse.model.qwen3moe import Qwen3MoeReference  # noqa: E402
from betelgeuse.store.reader import JITTER_ENV, Jitter  # noqa: E402
from services.assembly import open_runner, open_store  # noqa: E402

MiB = 1 << 20
ROWS: list[tuple[str, str, str]] = []        # (check, result, detail) for the markdown table
RESULTS: dict = {}


def row(check: str, ok: bool | None, detail: str):
    ROWS.append((check, "n/a" if ok is None else ("PASS" if ok else "FAIL"), detail))
    print(f"[{ROWS[-1][1]:>4}] {check}: {detail}", flush=True)


def models(tmp: Path, mid_layers: int, mid_preset: str = "small", names=("tiny", "mid")) -> dict[str, Path]:
    """tiny: 4 layers x 16 experts (~3 MB); mid: the 'small' preset (64 experts, top-8, hidden 512)
    with `mid_layers` layers (12: ~330 MB, so a 256 MiB arena view exists); only those in `names` are written.
    CHECK_PACK_EXPERTS=1: tiny's experts 64 wide (its 32 is not a whole tile of mma_pack's: startup would refuse);
    CHECK_QTYPE=Q4_K: tiny's tensors Q4_K, hidden and experts 256 wide (whole super-blocks); with CHECK_TILE_EXPERTS=1
    512 wide (a row of one super-block tiles to GGUF's own order: the check would hold nothing)."""
    tiny = PRESETS["tiny"]
    tile = os.environ.get("CHECK_TILE_EXPERTS") == "1"
    if os.environ.get("CHECK_PACK_EXPERTS") == "1" or tile:
        tiny = replace(tiny, n_ff_exp=64)
    if os.environ.get("CHECK_QTYPE") == "Q4_K":
        w = 512 if tile else 256
        tiny = replace(tiny, qtype="Q4_K", n_embd=w, head_dim=64, n_ff_exp=w)
    specs = {"tiny": tiny, "mid": replace(PRESETS[mid_preset], n_layer=mid_layers)}
    out = {}
    for name, spec in specs.items():
        if name not in names:
            continue
        p = tmp / f"check-{name}-{spec.n_embd}x{spec.n_ff_exp}x{spec.n_expert}-{spec.n_layer}L.gguf"
        if not p.exists():
            t = time.perf_counter()
            write_model(p, spec, progress=False)
            print(f"wrote {p} ({p.stat().st_size / MiB:.0f} MiB) in {time.perf_counter() - t:.1f} s", flush=True)
        out[name] = p
    return out


def ids_for(path, n: int, seed: int = 1) -> list[int]:
    V = GGUFModelFile.open(str(path)).config.n_vocab
    return [int(x) for x in torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed))]


def runner_for(path, device, vram, host, mode="in-process", **kw):
    """(runner, store): the store in this process, or (mode "process") the real store process over its sockets."""
    if os.environ.get("CHECK_VRAM_BUDGET"):     # under compute-sanitizer: its own device memory is not the worker's
        kw.setdefault("vram_budget", int(os.environ["CHECK_VRAM_BUDGET"]))
    if os.environ.get("CHECK_GROUP_GRAPHS") == "1":     # every check's engine with engine.group_graphs on (graph49)
        kw.setdefault("group_graphs", True)
    # engine.decode_fold (host57), engine.stream_points (host60) and engine.decode_gemv (gemv60), on by default since
    # gpu-run63: "0" turns one off, "1" on
    for env, key in (("CHECK_DECODE_FOLD", "decode_fold"), ("CHECK_STREAM_POINTS", "stream_points"),
                     ("CHECK_DECODE_GEMV", "decode_gemv")):
        if os.environ.get(env) in ("0", "1"):
            kw.setdefault(key, os.environ[env] == "1")
    if os.environ.get("CHECK_ACT_QUANT"):       # every check's engine with engine.act_quant so (e.g. bf16: tc51's MMA)
        kw.setdefault("act_quant", os.environ["CHECK_ACT_QUANT"])
    if os.environ.get("CHECK_PACK_EXPERTS") == "1":     # engine.pack_experts (vram62): with CHECK_ACT_QUANT=bf16
        kw.setdefault("pack_experts", True)
    if os.environ.get("CHECK_TILE_EXPERTS") == "1":     # engine.tile_experts (tile63): act_quant off
        kw.setdefault("tile_experts", True)
    cfg = EngineConfig(model_path=str(path), device=device, vram_slots=vram, host_slots=host, **kw)
    store = open_store(cfg, mode)
    try:
        return open_runner(cfg, store), store
    except BaseException:
        store.close()
        raise


def close(runner, store):
    runner.close()
    store.close()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def relaid(runner) -> tuple[int, int, int]:
    """engine.pack_experts / tile_experts at work: (layers relaid, VRAM experts held, of them flagged by bit 0 of their
    base offset: packed or tiled, ExpertCache._own)."""
    c = runner.session.cache
    held = c.vram_base >= 0
    return (0 if c.layouts is None else int((c.layouts != 0).sum()), int(held.sum()), int((c.vram_base[held] & 1).sum()))


def slot_passes(runner, ids, tag: str, got: dict, dec: dict):
    """cold / warm / consolidated all-token logits into got, then 4 greedy decode steps' logits into dec (the store
    pass stays open across them): what must be bit-identical across slot configurations."""
    for name, cons in (("cold", False), ("warm", True), ("consolidated", False)):
        logits, st = runner.forward(ids, runner.new_cache(len(ids) + 8), all_logits=True, consolidate=cons)
        runner.settle()
        got[f"{tag} {name} {st.reads}"] = logits.cpu()
    kv = runner.new_cache(len(ids) + 8)
    lg, _ = runner.forward(ids, kv)
    steps = []
    for _ in range(4):
        lg, _ = runner.forward([int(lg[-1].argmax())], kv, consolidate=False)
        steps.append(lg.cpu())
    runner.consolidate()
    dec[tag] = torch.cat(steps)


# ---- 1. invariance ---------------------------------------------------------------------------------

def check_invariance(path: Path, device: str, ids: list[int]):
    E = GGUFModelFile.open(str(path)).config.n_expert
    configs = [(0, 0), (0, E), (5, 15), (E, 0)]
    got: dict[str, torch.Tensor] = {}
    dec: dict[str, torch.Tensor] = {}
    relay = {}
    for vram, host in configs:
        runner, store = runner_for(path, device, vram, host)
        try:
            slot_passes(runner, ids, f"{vram}/{host}", got, dec)
            relay[f"{vram}/{host}"] = relaid(runner)
        finally:
            close(runner, store)
    if os.environ.get("CHECK_PACK_EXPERTS") == "1" or os.environ.get("CHECK_TILE_EXPERTS") == "1":
        # the relaid VRAM experts were read: every config holding VRAM experts flagged them all, in relaid layers
        ok = all(n == f and (n == 0 or l > 0) for l, n, f in relay.values()) and any(f for _, _, f in relay.values())
        row("invariance: VRAM experts relaid", ok, "slots: (layers relaid, VRAM experts held, flagged by bit 0) "
            + ", ".join(f"{k} {v}" for k, v in relay.items()))
    # the real store process, one config
    runner, store = runner_for(path, device, 5, 15, mode="process")
    try:
        for name in ("cold", "consolidated"):
            logits, st = runner.forward(ids, runner.new_cache(len(ids) + 8), all_logits=True)
            runner.settle()
            got[f"5/15 store-process {name} {st.reads}"] = logits.cpu()
    finally:
        close(runner, store)
    first = next(iter(got.values()))
    same = {k: torch.equal(v, first) for k, v in got.items()}
    d0 = next(iter(dec.values()))
    dsame = {k: torch.equal(v, d0) for k, v in dec.items()}
    row("invariance: decode steps x slots", all(dsame.values()), f"{sum(dsame.values())}/{len(dsame)} configs bit-identical "
        f"over 4 decode tokens (kernels: {runner.kern.backend if hasattr(runner, 'kern') else '?'})")
    row("invariance: slots x passes x store", all(same.values()),
        f"{sum(same.values())}/{len(same)} runs bit-identical (" + ", ".join(k for k, v in same.items() if not v) + ")")
    dtype = runner.dtype
    ref_dev = Qwen3MoeReference.load(path, device=device, dtype=dtype)
    with torch.no_grad():
        want_dev = ref_dev.forward(torch.tensor(ids), ref_dev.new_cache(len(ids) + 8)).float().cpu()
    row("invariance: == reference on device", torch.equal(first, want_dev),
        f"{dtype}, max |diff| {(first - want_dev).abs().max().item():.3e}")
    ref_cpu = Qwen3MoeReference.load(path)
    with torch.no_grad():
        want = ref_cpu.forward(torch.tensor(ids), ref_cpu.new_cache(len(ids) + 8)).float()
    diff = (first - want).abs().max().item()
    agree = (first.argmax(-1) == want.argmax(-1)).float().mean().item()
    row("vs CPU float32 reference", None if dtype != torch.float32 else diff <= 1e-4 * want.abs().max().item(),
        f"max |diff| {diff:.3e} (max |logit| {want.abs().max().item():.2f}), greedy tokens agree at {agree:.1%} of positions")
    RESULTS["invariance"] = {"runs": same, "dtype": str(dtype), "cpu_max_abs_diff": diff, "cpu_token_agreement": agree}


# ---- 1b. prefix cache and pieces: position-aligned chunks make a hit bit-identical to a miss -------------------

def check_prefix(path: Path, device: str, ids: list[int], chunk: int = 16):
    """The runner (5/15 slots, CUDA kernels and graphs as served): a prompt whose first whole chunks come from the
    prefix cache, and the same prompt in whole-chunk pieces, give the bits of one pass; so do 4 decode steps after
    the hit, batched with another sequence; and the chunked engine equals the chunked reference on the device."""
    from betelgeuse.worker.prefix_cache import PrefixCache
    runner, store = runner_for(path, device, 5, 15, prefill_chunk=chunk)
    try:
        c = runner.mcfg
        n = len(ids)
        whole, _ = runner.forward(ids, runner.new_cache(n + 8))
        pc = PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, chunk, 64 << 20, runner.device, runner.dtype)
        head = ids[: n // 2]
        kv1 = runner.new_cache(n + 8)
        runner.forward(head, kv1)
        pc.insert(kv1, head, len(head), [])
        kv2 = runner.new_cache(n + 8)
        got = pc.load(kv2, pc.lookup(ids))
        hit, _ = runner.forward(ids[got:], kv2)
        kv3, a, pieces = runner.new_cache(n + 8), 0, []
        while a < n:
            m = min(n - a, chunk * (1 + len(pieces) % 3))
            out, _ = runner.forward(ids[a:a + m], kv3)
            pieces.append(m)
            a += m
        row("prefix: hit == miss", torch.equal(hit.cpu(), whole.cpu()),
            f"{got} of {n} tokens from the cache, max |diff| {(hit - whole).abs().max().item():.3e}")
        row("prefix: pieces == one pass", torch.equal(out.cpu(), whole.cpu()), f"pieces {pieces}")
        # the host tier (the store's memfd, pinned): the head's blocks went there as they were cached; a new device
        # pool (a restarted worker) adopts them and copies them back: the bits of the miss again
        from betelgeuse.worker.prefix_host import HostTier
        arena = runner.session.prefix_arena
        if arena is not None:
            pc1 = PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, chunk, 64 << 20, runner.device, runner.dtype)
            pc1.host = HostTier(arena, c.n_layer, c.n_head_kv, c.head_dim, chunk, runner.dtype, 0)
            pc1.insert(kv1, head, len(head), [])            # written through to the host tier
            pc2 = PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, chunk, 64 << 20, runner.device, runner.dtype)
            pc2.host = HostTier(arena, c.n_layer, c.n_head_kv, c.head_dim, chunk, runner.dtype, 0)
            kv6 = runner.new_cache(n + 8)
            got6 = pc2.load(kv6, pc2.lookup(ids))
            hit6, _ = runner.forward(ids[got6:], kv6)
            row("prefix: host-tier hit == miss", got6 == got and pc2.stats.host_blocks > 0
                and torch.equal(hit6.cpu(), whole.cpu()), f"{got6} tokens from the host tier "
                f"({pc2.stats.host_blocks} blocks, pinned {runner.session._prefix_pinned}), max |diff| "
                f"{(hit6 - whole).abs().max().item():.3e}")
        # decode after the hit, batched with the piecewise sequence, equals solo decode after the miss
        kvm = runner.new_cache(n + 8)
        lg, _ = runner.forward(ids, kvm)
        t = int(lg[-1].argmax())
        solo, b = [], []
        tok_s, tok_b = t, [t, t]
        for _ in range(4):
            lg1, _ = (runner.decode_batch([tok_s], [kvm]) if runner.decodes_in_lanes       # how the engine decodes
                      else runner.forward([tok_s], kvm, consolidate=False))               # a lone sequence
            solo.append(lg1[0].cpu())
            tok_s = int(lg1[0].argmax())
            lgb, _ = runner.decode_batch(tok_b, [kv2, kv3])
            b.append(lgb.cpu())
            tok_b = [int(x) for x in lgb.argmax(-1)]
        runner.consolidate()
        ok = all(torch.equal(x[0], y) and torch.equal(x[1], y) for x, y in zip(b, solo))
        row("prefix: batched decode after hit == solo", ok, "4 steps, 2 sequences (hit, pieces) vs the miss alone")
        # three prompts (the whole one, its second half after the cached head, a short one) in ONE prefill pass:
        # every piece's logits (all rows) equal it prefilled alone
        short = ids[: chunk + 3]
        alone = [runner.forward(p, runner.new_cache(n + 8), all_logits=True)[0] for p in (ids, short)]
        kv4 = runner.new_cache(n + 8)
        pc.load(kv4, pc.lookup(ids))
        alone.insert(1, runner.forward(ids[got:], kv4, all_logits=True)[0])
        kv5 = runner.new_cache(n + 8)
        pc.load(kv5, pc.lookup(ids))
        together, st = runner.prefill_batch([(ids, runner.new_cache(n + 8)), (ids[got:], kv5),
                                             (short, runner.new_cache(n + 8))], all_logits=True)
        ok = all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(together, alone))
        diff = max((x - y).abs().max().item() for x, y in zip(together, alone))
        row("prefix: batched prefill == solo", ok, f"pieces {[n, n - got, len(short)]} in one pass, max |diff| "
            f"{diff:.3e}, {sum(st.reads.values())} expert applications")
        ref = Qwen3MoeReference.load(path, device=device, dtype=runner.dtype, chunk=chunk)
        with torch.no_grad():
            want = ref.forward(torch.tensor(ids), ref.new_cache(n + 8)).float()
        allr, _ = runner.forward(ids, runner.new_cache(n + 8), all_logits=True)
        row("prefix: chunked engine == chunked reference", torch.equal(allr.cpu(), want.cpu()),
            f"chunk {chunk}, {runner.kern.backend}, max |diff| {(allr - want).abs().max().item():.3e}")
        RESULTS["prefix"] = {"cached": got, "tokens": n, "pieces": pieces}
    finally:
        close(runner, store)


def greedy_decode(runner, prompt: list[int], steps: int, how: str, settle: bool = False):
    """Logits [steps, V] of `steps` greedy decode tokens after the prompt ("solo": runner.forward one token, as a
    lone sequence outside the lanes; "lanes": decode_batch, as the engine decodes), the tokens, and whether the
    last step was replayed from a captured graph. settle: the prompt's consolidation applied before the decode
    (an approximate routing mode depends on residency: it must not change under the steps at its own pace)."""
    kv = runner.new_cache(len(prompt) + steps + 8)
    lg, _ = runner.forward(prompt, kv)
    if settle:
        runner.settle()
    out, toks = [], []
    for _ in range(steps):
        toks.append(int(lg[-1].argmax()))
        lg, _ = (runner.decode_batch([toks[-1]], [kv]) if how == "lanes"
                 else runner.forward([toks[-1]], kv, consolidate=False))
        out.append(lg[-1:].float().cpu())
    if how == "lanes":
        ln = runner._lanes
        replayed = ln is not None and ln.seqs[kv.uid].mode == "replay" and all(p.mode == "replay" for p in ln.parts.values())
    else:
        replayed = any(isinstance(v, tuple) for k, v in runner.solo._graphs.items() if k[0] == kv.uid)
    runner.release(kv)
    runner.consolidate()
    return torch.cat(out), toks, replayed


def check_pool_decode(path: Path, device: str, prompt: list[int], vram: int, host: int, label: str,
                      exact: dict | None = None, steps: int = 8) -> dict:
    """pool routing (routing/approx.py) in the decode graphs: vram + host slots per layer (each layer partly
    resident after the prompt, settled), eager (cuda_graphs off) == capture / replay bit for bit, solo and lanes.
    exact: {(False, how): exact routing's eager logits} to report that pool differed. -> {(graphs, how pool): replayed}"""
    pool = {}
    for graphs in (False, True):
        runner, store = runner_for(path, device, vram, host, cuda_graphs=graphs, routing="pool")
        try:
            for how in ("solo", "lanes"):
                pool[graphs, how] = greedy_decode(runner, prompt, steps, how, settle=True)
        finally:
            close(runner, store)
    cuda = device.startswith("cuda")
    for how in ("solo", "lanes"):
        (a, ta, _), (b, tb, rep) = pool[False, how], pool[True, how]
        same = bool(torch.equal(a, b))
        differs = "" if exact is None else f"differs from exact: {not torch.equal(a, exact[False, how])}; "
        row(f"{label} {how} pool: eager == graphs", same and (rep or not cuda),
            f"{steps} pool-routed steps ({vram}+{host} slots) bit-identical: {same}; graphs replayed: {rep}; "
            f"same tokens: {ta == tb}; {differs}max |diff| {(a - b).abs().max().item():.3e}")
    return {(g, f"{h} pool"): v[2] for (g, h), v in pool.items()}


def check_batch(path: Path, device: str, steps: int = 8):
    """Batched decode over the lanes (worker/lanes.py: row-batched dense graphs and per-sequence attention graphs,
    eager, captured, replayed) equals each sequence decoded alone through them (how the engine decodes a lone
    sequence), while sequences sit out and rejoin (the batch changes, nothing recaptures); and agrees with the
    one-row decode of runner.forward to rounding (reported). Twice: keeping the graphs of 4 batch sizes, then of 1,
    where a change of batch size drops every captured graph of the shared pool and a later size captures anew."""
    prompts = [ids_for(path, n, seed) for n, seed in ((40, 3), (17, 5), (29, 7))]
    runner, store = runner_for(path, device, 5, 15)
    try:
        solo, rows = [], []
        for P in prompts:
            for lanes in (True, False):
                kv = runner.new_cache(len(P) + steps + 8)
                lg, _ = runner.forward(P, kv)
                out = []
                for _ in range(steps):
                    tok = int(lg[-1].argmax())
                    lg, _ = (runner.decode_batch([tok], [kv]) if lanes and runner.decodes_in_lanes
                             else runner.forward([tok], kv, consolidate=False))
                    out.append(lg[0].cpu())
                (solo if lanes else rows).append(out)
                runner.release(kv)
                runner.consolidate()
        graphs = runner._static_decode and runner.cache.is_cuda and runner.cfg.cuda_graphs
        ok, diff, modes, ms = True, 0.0, [], []
        # sequence 1 sits out and rejoins: sizes 3 2 3 2 3 3 3 3, then 3 3 3 2 2 2 3 3 (one size kept: 3's graphs
        # all go at the first 2, whose graphs are then captured into a new pool, and go again at the next 3)
        for keep, outs in ((None, (1, 3)), (1, (3, 4, 5))):
            kvs, last = [], []
            for P in prompts:
                kv = runner.new_cache(len(P) + steps + 8)
                lg, _ = runner.forward(P, kv)
                kvs.append(kv), last.append(int(lg[-1].argmax()))
            if runner._lanes is not None and keep is not None:
                runner._lanes.MAX_VARIANTS = keep
            got = [[] for _ in prompts]
            for step in range(steps):
                live = [0, 2] if step in outs else [0, 1, 2]
                t = time.perf_counter()
                lg, _ = runner.decode_batch([last[i] for i in live], [kvs[i] for i in live])
                sync(device)
                ms.append((time.perf_counter() - t) * 1e3)
                for j, i in enumerate(live):
                    got[i].append(lg[j].cpu())
                    last[i] = int(lg[j].argmax())
            runner.consolidate()
            ok = ok and all(torch.equal(x, y) for i in range(len(prompts)) for x, y in zip(got[i], solo[i]))
            ln = runner._lanes
            # lane graphs (per number of running rows: 3 and 2 here) and each sequence's attention graphs
            modes += (sorted({p.mode for p in ln.parts.values()}) + [ln.seqs[kv.uid].mode for kv in kvs]
                      if ln is not None else ["none (no static form)"])
            diff = max([diff] + [(x - y).abs().max().item() for i in range(len(prompts)) for x, y in zip(got[i], solo[i])])
            for kv in kvs:
                runner.release(kv)
        rdiff = max((x - y).abs().max().item() for i in range(len(prompts)) for x, y in zip(solo[i], rows[i]))
        row("batch: graphs == solo", ok and (not graphs or all(m == "replay" for m in modes)),
            f"2 x {steps} steps, 3 sequences (one sits out), 4 then 1 sizes kept, modes (lanes, seqs) {modes}, max |diff| {diff:.3e}; "
            f"pass ms {' '.join(f'{x:.0f}' for x in ms)}")
        row("batch: lanes ~ one-row decode", rdiff < 0.5, f"max |diff| {rdiff:.3e} (bf16 rounding of a different M)")
        RESULTS["batch"] = {"pass_ms": ms, "modes": modes, "lanes_vs_rows_max_diff": rdiff}
    finally:
        close(runner, store)


def check_recycle(path: Path, device: str, label: str, vram: int = 5, host: int = 15, steps: int = 6):
    """A second sequence on a recycled state (ModelRunner.new_cache: the first one's state, released, parked with its
    graphs and reset; issue 21): no decode graph captured during its steps (graphs.CAPTURED less engine.group_graphs'
    own captures: so its first step replayed too, an eager one would capture at the second), solo (runner.forward)
    and lanes (decode_batch), and its logits bit-identical to the same sequence's in a fresh runner (a stale length
    or state row would change them). -> {how: (captures of the first sequence, of the second)}"""
    from betelgeuse.worker import graphs as G
    prompts = [ids_for(path, 40, seed=3), ids_for(path, 29, seed=5)]
    n = max(map(len, prompts)) + steps + 8                  # one size: the second state is the first's, recycled

    def decode(runner, P, how):
        kv = runner.new_cache(n)
        lg, _ = runner.forward(P, kv)
        runner.settle()
        gg = getattr(runner.moe, "group_graphs", None)
        c0, g0 = G.CAPTURED[0], (gg.captures if gg is not None else 0)
        out = []
        for _ in range(steps):
            tok = int(lg[-1].argmax())
            lg, _ = (runner.decode_batch([tok], [kv]) if how == "lanes"
                     else runner.forward([tok], kv, consolidate=False))
            out.append(lg[-1:].float().cpu())
        caps = G.CAPTURED[0] - c0 - ((gg.captures if gg is not None else 0) - g0)
        runner.release(kv)
        runner.consolidate()
        return torch.cat(out), caps, kv

    cuda = device.startswith("cuda")
    res = {}
    for how in ("solo", "lanes"):
        runner, store = runner_for(path, device, vram, host, recycle_states=True)     # off by default: this checks it
        try:
            graphs = runner.recycle_states
            _, caps_a, kv_a = decode(runner, prompts[0], how)
            got, caps_b, kv_b = decode(runner, prompts[1], how)
        finally:
            close(runner, store)
        runner, store = runner_for(path, device, vram, host)
        try:
            want, _, _ = decode(runner, prompts[1], how)
        finally:
            close(runner, store)
        same = bool(torch.equal(got, want))
        res[how] = (caps_a, caps_b)
        replays = kv_b is kv_a and caps_a > 0 and caps_b == 0 if graphs else not cuda    # the CPU: no graphs
        row(f"{label} {how}: recycled state replays", same and replays,
            f"decode graphs captured by the first / second sequence {caps_a} / {caps_b} ({steps} steps each; "
            f"recycled: {kv_b is kv_a}); the second == a fresh runner's bit for bit: {same}, max |diff| "
            f"{(got - want).abs().max().item():.3e}")
    RESULTS.setdefault("recycle", {})[label] = res
    return res


# ---- 2. pinned arena -----------------------------------------------------------------------------------

def gbps(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> float:
    dst.copy_(src, non_blocking=True)
    sync(str(dst.device))
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    sync(str(dst.device))
    return reps * src.numel() / (time.perf_counter() - t) / 1e9


def check_pinned(path: Path, device: str):
    f = GGUFModelFile.open(str(path))
    E = f.config.n_expert
    runner, store = runner_for(path, device, 0, E)
    try:
        cache = runner.cache
        n = min(256 * MiB, cache.host.numel())
        view = cache.host[:n]
        pageable = torch.empty(n, dtype=torch.uint8)
        pageable.fill_(1)
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        is_cuda = device.startswith("cuda")
        pinned_flag = bool(cache.pinned)
        view_pinned = bool(view.is_pinned()) if is_cuda else False
        a, b = gbps(view, dst), gbps(pageable, dst)
        detail = (f"cache.pinned={pinned_flag}, arena view is_pinned()={view_pinned}; {n / MiB:.0f} MiB copy: "
                  f"arena {a:.1f} GB/s vs pageable {b:.1f} GB/s")
        row("pinned arena", (pinned_flag and view_pinned and a > 1.5 * b) if is_cuda else None, detail)
        RESULTS["pinned"] = {"cache_pinned": pinned_flag, "is_pinned": view_pinned, "bytes": n,
                             "arena_gbps": a, "pageable_gbps": b}
    finally:
        close(runner, store)


# ---- 3. copy/compute overlap --------------------------------------------------------------------------

def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap_fraction(trace: dict) -> tuple[float, float, int]:
    """(fraction of H2D memcpy time overlapping kernels on other streams, H2D ms, n copies)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    copies = [e for e in ev if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    total = covered = 0.0
    for c in copies:
        s, d = float(c["ts"]), float(c["dur"])
        stream = c.get("args", {}).get("stream")
        other = _union((float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels
                       if k.get("args", {}).get("stream") != stream and k["ts"] < s + d and k["ts"] + k["dur"] > s)
        total += d
        covered += sum(max(0.0, min(e, s + d) - max(b, s)) for b, e in other)
    return (covered / total if total else 0.0), total / 1e3, len(copies)


def check_overlap(path: Path, device: str, ids: list[int], outdir: Path | None):
    if not device.startswith("cuda"):
        row("overlap", None, "needs CUDA activity (skipped on the CPU)")
        return
    from torch.profiler import ProfilerActivity, profile
    runner, store = runner_for(path, device, 5, 15)
    res = {}
    try:
        for state in ("cold", "warm"):
            if state == "warm":
                runner.forward(ids, runner.new_cache(len(ids) + 8))     # consolidation, then profile the next pass
                runner.settle()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _, st = runner.forward(ids, runner.new_cache(len(ids) + 8), consolidate=(state == "cold"))
            runner.settle()
            tp = Path(outdir or tempfile.gettempdir()) / f"trace-{state}.json"
            prof.export_chrome_trace(str(tp))
            frac, ms, n = overlap_fraction(json.loads(tp.read_text()))
            res[state] = {"fraction": frac, "h2d_ms": ms, "copies": n, "reads": st.reads, "tok_per_s": st.tok_per_s}
            row(f"overlap ({state}, mid 5/15)", None,
                f"{frac:.0%} of {ms:.1f} ms H2D ({n} copies) overlaps compute; reads {st.reads}; {st.tok_per_s:.0f} tok/s")
    finally:
        close(runner, store)
    RESULTS["overlap"] = res


# ---- 4. PP tok/s ----------------------------------------------------------------------------------------

def check_pp(paths: dict[str, Path], device: str, n_tokens: dict[str, int]):
    res = {}
    for name, path in paths.items():
        ids = ids_for(path, n_tokens[name])
        for schedule in ("layer_major", "standard"):
            runner, store = runner_for(path, device, 5, 15, schedule=schedule)
            try:
                _, cold = runner.forward(ids, runner.new_cache(len(ids) + 8))
                runner.settle()
                _, warm = runner.forward(ids, runner.new_cache(len(ids) + 8), consolidate=False)
                sync(device)
            finally:
                close(runner, store)
            res[f"{name}/{schedule}"] = {"cold_tok_s": cold.tok_per_s, "warm_tok_s": warm.tok_per_s,
                                         "cold_reads": cold.reads, "warm_reads": warm.reads, "tokens": len(ids)}
        lm, sd = res[f"{name}/layer_major"], res[f"{name}/standard"]
        row(f"PP {name} ({n_tokens[name]} tok, 5/15)", None,
            f"layer-major cold {lm['cold_tok_s']:.1f} / warm {lm['warm_tok_s']:.1f} tok/s; standard cold "
            f"{sd['cold_tok_s']:.1f} / warm {sd['warm_tok_s']:.1f} tok/s; warm speed-up {lm['warm_tok_s'] / max(sd['warm_tok_s'], 1e-9):.2f}x")
    RESULTS["pp"] = res


# ---- 6. every expert type in the kernels; a K-quant model through the engine ------------------------------

def check_kernel_types(device: str, tmp: Path):
    cuda = device.startswith("cuda")
    res = {}
    if not cuda:
        row("kernels", None, "the device's kernels per type (skipped on the CPU: tests/test_kernels.py runs them there)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kernel_roofline as kr
    # the decode schedule (triton_mmvq) at one config per rows a program (BM_MV 1, 8, 16), for the types it has
    mv = {t: sorted({kr.CONFIGS[ci]["BM_MV"]: ci for ci in reversed(kr.mv_configs(t))}.values(),
                    key=lambda ci: kr.CONFIGS[ci]["BM_MV"]) for t in kr.TYPES}
    if cuda:                                          # the types' kernels compiled in parallel (the Triton cache)
        kr.warm_parallel([("bench", t, ci) for t in kr.TYPES for ci in [0, *mv[t]]],
                         min(len(kr.TYPES), (os.cpu_count() or 2) - 2), 240.0)
    for t in kr.TYPES if cuda else ():
        r = kr.check("bench", t, 0)
        res[t] = r
        row(f"kernels: {t}", r["finite"] and r["row_invariant"] and r["rel_err"] < 3e-2 and r["weights_rel_err"] < 1e-2,
            f"vs torch (bf16) {r['rel_err']:.1e}, weights {r['weights_rel_err']:.1e}, row-invariant {r['row_invariant']}")
        if mv[t]:
            rr = kr.check_rows(kr.check_setup("bench", t), cis=mv[t])
            res[t]["mmvq_rows"] = rr
            row(f"kernels: {t} mmvq rows", rr["ok"], f"BM_MV {[kr.CONFIGS[ci]['BM_MV'] for ci in mv[t]]}: each row's "
                f"bits the same at every rows a program and 1 / 3 / all tokens a launch; mismatches {rr['mismatch']}")
    for t in kr.BF16_TYPES_DEFAULT.split(",") if cuda else ():      # act_quant bf16: the bf16 MMA of the quants
        H, F, E, limit = kr.GEOMS["bench"]
        c = kr.bf16_check("bench", t, int(kr.GT[t]), H, F, E, limit)
        res.setdefault(t, {})["bf16"] = c
        row(f"kernels: {t} bf16 MMA", c["ok"], f"vs torch (bf16) {c['rel_err']:.1e} "
            f"(float path {c['float_rel_err']:.1e}),"
            f" row-invariant {c['row_invariant']}, word == byte loads {c['wl0_same_bits']}, KB 1 == KB 2 "
            f"{c['kb1_same_bits']} (not required)")
    from betelgeuse.gguf.synth import spec_from_preset
    spec = spec_from_preset("tiny", qtype="Q4_K_M", n_embd=256, n_ff_exp=256, n_head=4, head_dim=64)
    path = tmp / "check-tiny-q4km.gguf"
    if not path.exists():
        write_model(path, spec, progress=False)
    ids = ids_for(path, 40, seed=2)
    got: dict[str, torch.Tensor] = {}
    dec: dict[str, torch.Tensor] = {}
    for vram, host in ((0, 0), (3, 5), (spec.n_expert, 0)):
        runner, store = runner_for(path, device, vram, host)
        try:
            backend = runner.kern.backend
            slot_passes(runner, ids, f"{vram}/{host}", got, dec)
        finally:
            close(runner, store)
    first, d0 = next(iter(got.values())), next(iter(dec.values()))
    same = all(torch.equal(v, first) for v in got.values()) and all(torch.equal(v, d0) for v in dec.values())
    ref = Qwen3MoeReference.load(path, device=device, dtype=runner.dtype)
    with torch.no_grad():
        want = ref.forward(torch.tensor(ids), ref.new_cache(len(ids) + 8)).float().cpu()
    row("kernels: Q4_K_M engine", same and backend == ("triton" if cuda else "torch") and torch.equal(first, want),
        f"{backend}, {len(got)} runs + decode bit-identical: {same}; == reference on device: {torch.equal(first, want)}")
    RESULTS["kernels"] = res


def run_steps(steps, only: str):
    """Run the named checks listed in `only` (comma-separated), each timed; a check that raises is a FAIL row and
    the others still run (one table with every check)."""
    for name, fn in steps:
        if name not in only.split(","):
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:                       # keep going: one table with every check
            import traceback
            traceback.print_exc()
            row(name, False, f"raised {type(e).__name__}: {e}")
        print(f"  ({name}: {time.perf_counter() - t:.1f} s)", flush=True)


def timing_flag(p: argparse.ArgumentParser):
    p.add_argument("--adversarial-timing", metavar="SEED:MS",
                   help="test-only: every store these checks make (in-process and the store process) holds each expert "
                        "read back by a seeded random delay of up to MS ms and hands staged copies out shuffled")


def use_timing(value: str | None):
    """--adversarial-timing: checked now (a bad value fails before any work), then set for every store made from here
    on (ExpertReader reads it; child processes inherit it)."""
    if value:
        try:
            Jitter.parse(value)
        except BetelgeuseError as e:
            raise SystemExit(f"{Path(sys.argv[0]).name}: error: --adversarial-timing: {e}") from None
        os.environ[JITTER_ENV] = value
        RESULTS["adversarial_timing"] = value


def parse_checks(p: argparse.ArgumentParser, prog: str) -> argparse.Namespace | None:
    """Both check scripts' start: --adversarial-timing added, the arguments parsed and the timing set (use_timing),
    --tmp made, RESULTS' device and torch filled. None, after a one-line error, where a cuda device has no CUDA."""
    timing_flag(p)
    a = p.parse_args()
    use_timing(a.adversarial_timing)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{prog}: error: CUDA is not available (use --device cpu to run the checks on the CPU)")
        return None
    Path(a.tmp).mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    RESULTS["torch"] = torch.__version__
    return a


def finish_checks(prog: str, out: Path | None) -> int:
    """Both check scripts' end: the table of every row printed and, with `out`, written there as PROG.md (RESULTS as
    PROG.json) -> the exit status, 1 if any check failed."""
    md = results_table(prog)
    print("\n" + md, flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{prog}.md").write_text(md + "\n")
        (out / f"{prog}.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return 1 if any(r == "FAIL" for _, r, _ in ROWS) else 0


def results_table(title: str) -> str:
    """The markdown table of every row so far."""
    timing = f", adversarial timing {RESULTS['adversarial_timing']}" if RESULTS.get("adversarial_timing") else ""
    return "\n".join([f"## {title} on {RESULTS['device']} (torch {RESULTS['torch']}{timing})", "",
                      "| check | result | detail |", "|---|---|---|"]
                     + [f"| {c} | {r} | {d.replace('|', '/')} |" for c, r, d in ROWS])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tmp", default="/tmp/bg-check")
    p.add_argument("--mid-layers", type=int, default=12)
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens for the mid model (tiny: half)")
    p.add_argument("--mid-preset", default="small", help="synth preset of the mid model (bench: the benchmark geometry)")
    p.add_argument("--only", default="invariance,prefix,batch,pool,recycle,pinned,overlap,pp,kernels",
                   help="comma-separated steps to run")
    a = parse_checks(p, "check_cuda")
    if a is None:
        return 2
    tmp = Path(a.tmp)
    outdir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if outdir:
        outdir.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(","))
    paths = models(tmp, a.mid_layers, a.mid_preset,
                   names=[n for n, uses in (("tiny", {"invariance", "pool", "recycle", "pp"}),
                                            ("mid", {"prefix", "batch", "pinned", "overlap", "pp"})) if only & uses])
    steps = [("invariance", lambda: check_invariance(paths["tiny"], a.device, ids_for(paths["tiny"], 48, seed=0))),
             ("prefix", lambda: check_prefix(paths["mid"], a.device, ids_for(paths["mid"], 150, seed=4))),
             ("batch", lambda: check_batch(paths["mid"], a.device)),
             ("pool", lambda: check_pool_decode(paths["tiny"], a.device, ids_for(paths["tiny"], 40, seed=6), 2, 4,
                                                "tiny decode")),
             ("recycle", lambda: check_recycle(paths["tiny"], a.device, "tiny decode")),
             ("pinned", lambda: check_pinned(paths["mid"], a.device)),
             ("overlap", lambda: check_overlap(paths["mid"], a.device, ids_for(paths["mid"], a.tokens), outdir)),
             ("pp", lambda: check_pp(paths, a.device, {"tiny": max(8, a.tokens // 2), "mid": a.tokens})),
             ("kernels", lambda: check_kernel_types(a.device, tmp))]
    run_steps(steps, a.only)
    return finish_checks("check_cuda", outdir)


if __name__ == "__main__":
    raise SystemExit(main())
