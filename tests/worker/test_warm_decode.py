"""Issue 21: decode's dense kernels compiled at attach (worker/warm_decode.py), forced on the CPU.

The warm-up runs one dense-only decode step per form (solo, the batched lanes) on scratch states; after it, nothing
observable may differ from a runner without it: the logits of a prefill and of static-form decode steps (solo and
lanes), every pass's stats (reads, store messages by kind, guesses, per-layer tiers), the session's store calls and
the directory of the store. With deepseek4's TritonOps under Triton's interpreter and the launch recorder
(kernels/triton_launch.record_variants), every dense-kernel variant (the compile key: constexprs, launch options,
each argument's specialization) a decode launches must be among those the warm-up launched, solo and lanes alike.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from betelgeuse.kernels import triton_launch as TL

from engine_helpers import close_runner, in_process_runner, prompt, write_tiny_pair

# the expert kernels' variants are MoEStep.warm_kernels' (tests/kernels/test_triton_variants.py)
MOE_KERNELS = ("_gate_up_kernel", "_down_kernel", "_gate_up_mv_kernel", "_down_mv_kernel", "_combine_kernel",
               "_gate_up_mmq_kernel", "_down_mmq_kernel", "_quantize_kernel")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("warm_decode"))


def _figures(st) -> dict:
    """A pass's stats less its clocks: what the warm-up must not change."""
    keep = ("kind", "tokens", "reads", "disk_bytes", "h2d_bytes", "in_place_bytes", "flex_hits", "prefetched",
            "guessed", "guess_hits", "guess_disk", "guess_bytes", "guess_wasted_bytes", "guess_held", "vram_filled",
            "fill_disk", "store_calls")
    out = {k: getattr(st, k) for k in keep if hasattr(st, k)}
    out["store_rpc"] = {k: v[0] for k, v in st.store_rpc.items()}
    out["layers"] = [(x.vram, x.host, x.disk, x.synced, x.groups) for x in st.layers]
    return out


def _triton_ops(rn):
    """deepseek4's dense ops as CUDA runs them (TritonOps; under TRITON_INTERPRET=1 on the CPU)."""
    from betelgeuse.kernels.triton_ds4 import TritonOps
    rn.model.ops = TritonOps()
    rn.model.ops.prepare(rn.model.w, rn.mcfg.n_layer)


def _run(path, warm: bool, triton_ops: bool = False):
    """Attach (the warm-up forced or not), prefill two prompts, settle, 3 solo static steps of one, then 2 lane
    steps of both -> (logits, figures of every pass, warm-up result, warm-up variants, decode variants). Prompts of
    21 and 1 tokens: the first still past the sliding window (16) with more compressed entries (5 at ratio 4) than
    the indexer keeps (4); a decode's dense variants follow the state lengths (136, 256: warm_decode's doc), not the
    prompt: 24 and 5 tokens gave the same 44 decode variants, at ~1.4x the prefill time."""
    rn, st = in_process_runner(path, 2, 3, kernels="triton", decode_consolidate_every=0, max_running=2,
                               read_threads=1)
    try:
        if triton_ops:
            _triton_ops(rn)
        assert rn.warmed is None or "decode" not in rn.warmed       # the CPU: not at attach ...
        TL.record_variants()
        got = rn.warm_decode(force=True) if warm else None          # ... unless asked
        warmed = TL.record_variants(False)
        V = rn.mcfg.n_vocab
        kv, kv2 = rn.new_cache(136), rn.new_cache(256)
        out, figs = [], []
        lg, s = rn.forward(prompt(21, V, seed=3), kv)
        out.append(lg[-1])
        figs.append(_figures(s))
        lg2, s = rn.forward(prompt(1, V, seed=4), kv2)
        out.append(lg2[-1])
        figs.append(_figures(s))
        rn.settle()
        rn._static_decode = True                    # CUDA's form, eagerly here
        TL.record_variants()
        for _ in range(3):
            lg, s = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            out.append(lg[-1])
            figs.append(_figures(s))
        toks = [int(lg[-1].argmax()), int(lg2[-1].argmax())]
        for _ in range(2):
            lgb, s = rn.decode_batch(toks, [kv, kv2])
            toks = [int(x) for x in lgb.argmax(-1)]
            out.append(lgb.reshape(-1))
            figs.append(_figures(s))
        dec = TL.record_variants(False)
        rn.request_done(kv, others_running=True)
        rn.request_done(kv2, others_running=False)
        figs.append({"calls": rn.session.calls, "kv_bytes": rn.kv_bytes,
                     "flex": None if rn.flex is None else rn.flex.describe()})
        return torch.cat([o.reshape(-1) for o in out]), figs, got, warmed, dec
    finally:
        TL.record_variants(False)
        close_runner(rn, st)


@pytest.mark.parametrize("arch", ["deepseek4"])     # the runner's warm-up code is the architectures' one (qwen3moe:
def test_warm_decode_changes_nothing(models, arch):     # the same interface calls; left out for CI's time)
    """With and without the warm-up: the same logits, pass figures and store calls. deepseek4 under Triton's
    interpreter runs its TritonOps (CUDA's dense kernels), and then every dense-kernel variant its decode launches
    (solo and lanes) must be among those the warm-up launched."""
    ops = arch == "deepseek4" and os.environ.get("TRITON_INTERPRET") == "1"
    t = time.perf_counter()
    got, figs, res, warmed, dec = _run(models[arch], True, triton_ops=ops)
    want, figs0, none, _, dec0 = _run(models[arch], False, triton_ops=ops)
    assert none is None and res is not None and "skipped" not in res, res
    assert res["lanes"] == 2 and res["solo"] and res["seconds"] > 0, res
    assert torch.equal(got, want)
    assert figs == figs0
    assert any(f.get("store_calls") for f in figs[:-1]), figs      # the passes did talk to the store
    if not ops:
        return
    dense = {v for v in dec if v[0] not in MOE_KERNELS}
    names = {v[0] for v in dense}
    # the model's decode kernels ran (solo and lanes: hc_*, rms_rope, the compressor, indexer, attention, routing,
    # the lanes' row copies), the same with and without the warm-up
    assert {"_decode_attn_kernel", "_compress_step_kernel", "_index_scores_kernel", "_route_kernel",
            "_copy_rows_kernel", "_rms_rope_kernel"} <= names, sorted(names)
    assert dense == {v for v in dec0 if v[0] not in MOE_KERNELS}
    missing = dense - warmed
    assert not missing, (sorted(missing, key=str), time.perf_counter() - t)
