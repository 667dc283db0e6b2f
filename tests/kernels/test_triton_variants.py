"""Issue 21: no Triton compile inside a timed decode step.

The compile counter (kernels/triton_launch.watch_compiles) chains Triton's jit_cache_hook / jit_post_compile_hook:
checked here on the hooks' own payload shape (the CPU compiles nothing: under the interpreter it says n/a). The
decode's expert-kernel variants (the compile keys the Launcher recorder sees: constexprs, launch options, each
argument's specialization) must all be among those MoEStep.warm_kernels launched at attach, over a slot configuration
that gives at-hand groups, miss groups with banked host experts merged into the first disk group, and one-expert
groups, solo and in the batched lanes; and the warm-up must not change a bit of the decode.
"""

from __future__ import annotations

import os
import types
from collections import Counter

import numpy as np
import pytest
import torch

from betelgeuse.kernels import triton_launch as TL
from services.bench.report import triton_compiles

MOE_KERNELS = ("_gate_up_kernel", "_down_kernel", "_gate_up_mv_kernel", "_down_mv_kernel", "_combine_kernel",
               "_gate_up_mmq_kernel", "_down_mmq_kernel", "_quantize_kernel", "_sort_rows_kernel")


def test_compile_hooks_count_chain_and_pass_a_skip_through(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    rt = knobs.runtime
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(TL, "_WATCH", {"na": "not watched"})
    monkeypatch.setattr(TL, "COMPILES", [])
    seen = []

    def pre(**kw):                      # a hook set before ours (a profiler): still called, its answer kept
        seen.append(("pre", kw["key"]))
        return kw["key"] == "skip"

    def post(**kw):
        seen.append(("post", kw["key"]))
    monkeypatch.setattr(rt, "jit_cache_hook", pre)
    monkeypatch.setattr(rt, "jit_post_compile_hook", post)
    assert TL.watch_compiles() and TL.watch_compiles()      # idempotent: chained once
    m = TL.compile_mark()
    jf = types.SimpleNamespace(arg_names=["x_ptr", "n", "BM", "EP"])
    fn = types.SimpleNamespace(name="betelgeuse.kernels.triton_moe._gate_up_kernel", jit_function=jf)
    payload = dict(repr="r", fn=fn, compile={"constants": {(1,): 1, (2,): 16, (3,): 256}}, is_manual_warmup=False,
                   already_compiled=False)
    assert not rt.jit_cache_hook(key="k1", **payload)       # falsy: Triton compiles
    rt.jit_post_compile_hook(key="k1", **payload)
    assert rt.jit_cache_hook(key="skip", **payload)         # the chained hook's skip is Triton's answer
    got = TL.compiles_since(m)
    assert got["count"] == 1 and got["names"] == {"_gate_up_kernel": 1} and got["seconds"] >= 0
    assert got["variants"][0].startswith("_gate_up_kernel[n=1,BM=16,EP=256]"), got
    assert seen == [("pre", "k1"), ("post", "k1"), ("pre", "skip")]


def test_a_compile_names_its_registers_and_spills(monkeypatch):
    """Each compile's resources come from the JIT's cache (device_caches[device][0][key], Triton 3.6 and 3.9) when
    compiles_since is asked: registers, local bytes per thread (Triton's n_spills x 4: the driver's local-memory
    reservation follows them), shared bytes; a spilling variant is named; a kernel not loaded yet has no regs."""
    rt = pytest.importorskip("triton").knobs.runtime
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(TL, "_WATCH", {"na": "not watched"})
    monkeypatch.setattr(TL, "COMPILES", [])
    monkeypatch.setattr(rt, "jit_cache_hook", None)
    monkeypatch.setattr(rt, "jit_post_compile_hook", None)
    assert TL.watch_compiles()

    def kernel(regs, spills, shared):
        k = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=shared))
        if regs is not None:                        # set by _init_handles, at the module's first launch
            k.n_regs, k.n_spills = regs, spills
        return k
    cache = {"a": kernel(40, 0, 1024), "b": kernel(255, 300, 0), "c": kernel(None, None, 512)}
    jf = types.SimpleNamespace(arg_names=["x_ptr", "BM"], device_caches={0: (cache, {}, "target", "backend", None)})
    m = TL.compile_mark()
    for key, name in (("a", "_rms_kernel"), ("b", "_down_kernel"), ("c", "_route_kernel"), ("d", "_x_kernel")):
        fn = types.SimpleNamespace(name=f"betelgeuse.kernels.k.{name}", jit_function=jf)
        payload = dict(repr="r", fn=fn, compile={"constants": {(1,): 16}, "device": 0}, is_manual_warmup=False,
                       already_compiled=False)
        rt.jit_cache_hook(key=key, **payload)
        rt.jit_post_compile_hook(key=key, **payload)
    got = TL.compiles_since(m)
    v = got["variants"]
    assert v[0].startswith("_rms_kernel[BM=16]") and v[0].endswith(" s regs 40, local 0 B, smem 1024 B"), v
    assert v[1].endswith(" s regs 255, SPILLS local 1200 B, smem 0 B"), v
    assert v[2].endswith(" s smem 512 B") and v[3].endswith(" s"), v      # not loaded yet; not in the cache
    assert got["max_local"] == 1200 and got["spilling"] == [v[1]] and "lmem_mib" not in got, got     # the CPU
    assert "SPILLING (1, max 1200 B/thread): `_down_kernel[BM=16]" in triton_compiles(got)
    monkeypatch.setattr(TL, "_resident_threads", lambda: 132 * 2048)            # an H100 SXM
    got = TL.compiles_since(m)
    assert got["lmem_mib"] == 309.4, got                                        # 1,200 B x 270,336 threads
    assert "max 1200 B/thread, ~309 MiB of local memory reserved)" in triton_compiles(got)


def test_compiles_are_not_counted_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(TL, "_WATCH", {"na": "not watched"})
    assert not TL.watch_compiles()
    got = TL.compiles_since(TL.compile_mark())
    assert got["count"] is None and "interpreter" in got["na"]


def test_recorder_keys_follow_tritons_specialization():
    """The recorded key changes where Triton compiles another kernel (an int == 1, a multiple of 16, an address not
    16-byte aligned, a constexpr) and only there; off, nothing is recorded."""
    pytest.importorskip("triton")
    from betelgeuse.kernels import triton_norm  # noqa: F401  (a launcher to record with)
    launch = triton_norm._rms_kernel
    x = torch.zeros(64)
    keys = [launch.variant((x, x, x, d, 1e-6), {"BD": 64}) for d in (7, 9, 16, 32, 1)]
    keys.append(launch.variant((x[1:], x, x, 7, 1e-6), {"BD": 64}))
    keys.append(launch.variant((x, x, x, 7, 1e-6), {"BD": 128}))
    assert keys[0] == keys[1] and keys[2] == keys[3]
    assert len({keys[0], keys[2], keys[4], keys[5], keys[6]}) == 5, keys
    assert TL.VARIANTS is None
    TL.record_variants()
    try:
        triton_norm.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
        triton_norm.rms_norm(torch.ones(3, 8), torch.ones(8), 1e-6)     # rows: the grid only
    finally:
        got = TL.record_variants(False)
    assert len(got) == 1 and next(iter(got))[0] == "_rms_kernel" and TL.VARIANTS is None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine_helpers import ENGINE_SPEC, write_synth
    return write_synth(tmp_path_factory.mktemp("variants") / "m.gguf", **{**ENGINE_SPEC, "n_expert": 16})


def _decode(model, vram, host, extra, warm: bool):
    """Prompt, settle, 3 solo static-form steps, then 2 batched-lane steps of two sequences, on the triton kernels
    (TRITON_INTERPRET=1 on the CPU) -> (logits, warm-up variants, decode variants, group sizes seen). The prompts are
    2 and 1 tokens: the prefill only places experts in the tiers, and a decode's expert-kernel variants follow its
    own rows and groups, not the prompt's (24- and 5-token prompts gave the same 4 decode variants and the same group
    kinds: at-hand, 1- and 2-expert miss groups, solo and lanes; their bucket-16 prefill was ~60% of the time)."""
    from engine_helpers import close_runner, in_process_runner, prompt
    rn, st = in_process_runner(model, vram, host, kernels="triton", decode_consolidate_every=0, max_running=2,
                               read_threads=1, **extra)
    try:
        TL.record_variants()
        if warm:
            assert rn.warmed is None            # the CPU: not at attach ...
            assert rn.moe.warm_kernels(rn.model, force=True)["groups"] > 0      # ... unless asked
        warmed = TL.record_variants(False)
        V = rn.mcfg.n_vocab
        kv, kv2 = rn.new_cache(64), rn.new_cache(64)
        lg, _ = rn.forward(prompt(2, V, seed=3), kv)
        rn.forward(prompt(1, V, seed=4), kv2)
        rn.settle()
        rn._static_decode = True
        sizes = Counter()
        apply = rn.moe.kern.apply

        tables = rn.moe.cache._tables_np      # a group's slot table (MoEStep._group): triton groups carry no ids

        def counted(r, layer, pool, g, *a, **kw):
            n = len(g.experts) if g.experts is not None else (
                int((g.base_host >= 0).sum()) if np.shares_memory(g.base_host, tables) else 0)
            if n:
                sizes[min(n, 2)] += 1
            return apply(r, layer, pool, g, *a, **kw)
        rn.moe.kern.apply = counted
        TL.record_variants()
        out = []
        for _ in range(3):
            lg, _ = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            out.append(lg[-1])
        for _ in range(2):
            lg2, _ = rn.decode_batch([int(out[-1].argmax()), 7], [kv, kv2])
            out.append(lg2.reshape(2, -1))
        dec = TL.record_variants(False)
        return torch.cat([o.reshape(-1) for o in out]), warmed, dec, sizes
    finally:
        TL.record_variants(False)
        close_runner(rn, st)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU's interpreter run (CUDA compiles)")
def test_decode_launches_only_the_variants_warmed_at_attach(model):
    seen = Counter()
    # two VRAM + three host slots, host experts banked, banks of 2: at-hand groups, banked host experts merged into
    # the first disk group, one-expert groups (one configuration: the interpreter's decode is slow, CI's time)
    for vram, host, extra, twice in [(2, 3, dict(host_in_place="never", ring_slots=4), True)]:
        got, warmed, dec, sizes = _decode(model, vram, host, extra, True)
        where = (vram, host, extra)
        moe = {v for v in dec if v[0] in MOE_KERNELS}
        if twice:           # without the warm-up (once: the interpreter's decode is slow): the same bits and variants
            want, _, dec0, _ = _decode(model, vram, host, extra, False)
            assert torch.equal(got, want), where             # the warm-up reads and writes nothing of the decode's
            assert moe == {v for v in dec0 if v[0] in MOE_KERNELS}, where
        assert moe and moe <= warmed, (where, sorted(moe - warmed, key=str))
        assert {v[0] for v in warmed} <= set(MOE_KERNELS), where
        seen.update(sizes)
    assert seen[1] and seen[2], seen        # one-expert groups and larger ones (banks, merged misses) ran


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU's interpreter run (CUDA compiles)")
def test_a_pass_of_any_size_launches_only_variants_the_warm_up_launched(monkeypatch):
    """MoEKernels.warm(prefill=P) launches, besides decode's groups, the fewest T that reach each other variant a pass
    of up to P tokens can (triton_moe.launch_kinds): every group of 1..P tokens then launches warmed variants only. A
    first 512-token prompt compiled its rows-16 and walked (unsplit) variants, ~2 s of TTFT on a cold Triton cache
    (gpu-run46-serve). WS_LIMIT is shrunk so that split-K turns off within a few tokens here, as it does at 85 and
    257 tokens on the bench geometry. Fails without the prefill probes (checked below)."""
    from betelgeuse.kernels import triton_moe as tm
    from betelgeuse.kernels.moe import Group, MoEKernels
    E, H, F, k, P, MXFP4 = 8, 512, 512, 2, 5, 39         # MXFP4: its rows-1 and rows-16 schedules differ
    code = tm.QT_CODES[MXFP4]
    monkeypatch.setitem(tm.TUNING, code, {**tm.TUNING[code], "reduce": {"BK": 256, "KC": 256}})   # 2 chunks of K
    monkeypatch.setattr(tm, "WS_LIMIT", 1 << 20)
    monkeypatch.setattr(tm, "_PLANS", {})
    kern = MoEKernels("triton", E, F, torch.zeros((1, E, 3), dtype=torch.int64), [(MXFP4, MXFP4)], 8)
    pool, slot = torch.zeros(1024, dtype=torch.uint8), 1024
    probes = tm.launch_kinds(code, code, E, H, F, k, None, H // 32 * 17, F // 32 * 17,
                             True, torch.float32, pool.device, P)
    assert probes == [1, 4, 5], probes       # rows-1 split-K, gate_up walked from 4 tokens, rows-16 from 5

    def launched(**warm):
        TL.record_variants()
        try:
            if warm:
                kern.warm(pool, slot, H, k, torch.float32, [1], **warm)
            else:
                g = Group(None, None, torch.full((E,), -1, dtype=torch.int64))
                for T in range(1, P + 1):
                    ids = (torch.arange(T * k) % E).view(T, k)
                    r = kern.route(torch.zeros((T, H)), ids, torch.zeros((T, k)))
                    kern.apply(r, 0, pool, g, slot)
                    kern.combine(r)
        finally:
            got = TL.record_variants(False)
        return got

    passes = launched()
    assert passes <= launched(prefill=P), sorted(passes - launched(prefill=P), key=str)
    assert not passes <= launched(prefill=0)         # decode's groups alone miss some: the probes are what warm them
