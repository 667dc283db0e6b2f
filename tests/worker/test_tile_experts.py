"""engine.tile_experts (issue 23, docs/benchmarks/cpu-tile63): the VRAM slots of the layers whose experts gained on the
device (Q8_0, Q4_K: kinds.TILE_QTYPES) and run triton_moe's float kernels hold kernels/tile_layout's 64-row tiles,
retiled as they fill (ExpertCache._own; the slot bytes against the file's: tests/worker/test_pack_experts.py),
flagged by bit 0, read by the kernels' `tiled` launches. Here: which layers tile and why the others do not
(MoEKernels.tile_check), the plan's scratch, the torch kernels' startup, and the engine's logits with tiles on == off
bit for bit under the Triton interpreter (tests/scripts/tile_engine_check.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, write_synth

from betelgeuse.config import EngineConfig
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.plan import vram_needs

TESTS = Path(__file__).resolve().parents[1]


def _parts(shapes, qtypes):
    """ExpertCache.parts' stand-in: one layer a (shapes, qtypes) pair, one expert (tile_check reads expert 0)."""
    return [[[SimpleNamespace(shape=sh, qtype=q) for sh, q in zip(shapes, qts)]] for qts in qtypes]


def test_tile_check_tiles_the_float_kernels_q8_0_and_q4_k_layers_and_says_why_not(monkeypatch):
    """MoEKernels.tile_check: act_quant off, the triton kernels: Q8_0 and Q4_K layers of whole tiles tile; a layer
    mixing in another type (Q6_K down), MXFP4 (no gain on the device), F16, rows not a multiple of 64, a packed layer
    do not, each with its reason; act_quant auto: Q4_K only (Q8_0 runs the bf16 MMA); bf16: none; the torch kernels:
    none; a type whose config takes the decode schedule (MV) in a bucket: not that type's layers. Fails with any of
    those conditions dropped."""
    pytest.importorskip("triton")
    from betelgeuse.kernels import triton_moe
    from betelgeuse.kernels.moe import MoEKernels
    s256 = [(256, 256)] * 3
    layers = _parts(s256, [(8, 8, 8), (12, 12, 12), (12, 12, 14), (39, 39, 39), (1, 1, 1), (8, 8, 8)])
    layers[5][0][2] = SimpleNamespace(shape=(96, 256), qtype=8)            # down [96 rows, 256]: not whole tiles
    starts = torch.zeros((len(layers), 1, 3), dtype=torch.int64)
    qts = [(ps[0][0].qtype, ps[0][2].qtype) for ps in layers]

    def check(backend="triton", act_quant="off", packed=()):
        k = MoEKernels(backend, 1, 256, starts, qts, 16, act_quant=act_quant)
        k.packed[list(packed)] = True
        got, why = k.tile_check(layers)
        return got.tolist(), {l: w for w, ls in why.items() for l in ls}

    got, why = check()
    assert got == [True, True, False, False, False, False], why
    assert "[12, 14]" in why[2] and "[39]" in why[3] and "[1]" in why[4] and "(96, 256)" in why[5], why
    got, why = check(packed=[0])
    assert got == [False, True, False, False, False, False] and "packed" in why[0], why
    got, why = check(act_quant="auto")
    assert got == [False, True, False, False, False, False] and "MMA" in why[0], why
    assert check(act_quant="bf16")[0] == [False] * 6
    got, why = check("torch")
    assert got == [False] * 6 and "kernels: torch" in why[0] and "kernels: torch" in why[1], why
    monkeypatch.setitem(triton_moe.TYPE_CONFIG, triton_moe.QT_CODES[12], {"MV": 1})   # Q4_K: the decode schedule
    got, why = check()
    assert got == [True, False, False, False, False, False] and "(MV)" in why[1], why


def test_plan_counts_the_scratch_where_a_layer_may_tile(tmp_path):
    """vram_needs' ring part: one slot more with tile_experts on a Q8_0 model (act_quant off), nothing on an F16 model
    (no type of TILE_QTYPES) or under act_quant bf16 (Q8_0 on the MMA), and with pack_experts on too packing's scratch
    and index alone (one scratch). Fails with the scratch left out of the plan or counted twice."""
    q8 = write_synth(tmp_path / "q8.gguf", **ENGINE_SPEC)
    f16 = write_synth(tmp_path / "f16.gguf", **{**ENGINE_SPEC, "qtype": "F16"})
    for path, kw, extra in ((q8, {}, 4096), (f16, {}, 0), (q8, {"act_quant": "bf16"}, 0),
                            (q8, {"act_quant": "bf16", "pack_experts": True}, 4096 + 8 * 64 * 68)):   # + K 64's index
        f = GGUFModelFile.open(path)
        on = vram_needs(f, EngineConfig(model_path=str(path), tile_experts=True, **kw), 4096, 1)["ring"]
        off = vram_needs(f, EngineConfig(model_path=str(path), act_quant=kw.get("act_quant", "off")), 4096, 1)["ring"]
        assert on - off == extra, (path, kw, on, off)


def test_torch_kernels_tile_nothing_and_say_why(tmp_path, caplog):
    """tile_experts on the CPU's default torch kernels: the runner starts, no layer tiles (the torch path reads GGUF
    bytes only: no VRAM slot flagged, no scratch), and the log names the layers and why."""
    q8 = write_synth(tmp_path / "q8.gguf", **ENGINE_SPEC)
    with caplog.at_level(logging.INFO, logger="betelgeuse.worker"):
        rn, st = in_process_runner(q8, 2, 3, tile_experts=True)
    try:
        c = rn.session.cache
        assert rn.kern.backend == "torch" and c.layouts is None and c._scratch is None and not rn.kern.tiled.any()
        rec = {r.getMessage(): r.fields for r in caplog.records if r.getMessage().startswith("tile_experts")}
        assert rec["tile_experts"]["layers"] == 0, rec
        assert rec["tile_experts_gguf"]["layers"] == "0,1,2" and "kernels: torch" in rec["tile_experts_gguf"]["why"]
    finally:
        close_runner(rn, st)


def _engine_check(tmp_path, qtype: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(TESTS) + os.pathsep + str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(TESTS / "scripts" / "tile_engine_check.py"), str(tmp_path / "m.gguf"),
                        qtype], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("qtype", ["Q8_0", pytest.param("Q4_K", marks=pytest.mark.slow)])
def test_tiled_engine_logits_equal_the_untiled_engines_bit_for_bit(tmp_path, qtype):
    """The engine with the triton kernels (interpreted) and tile_experts on: every layer tiled, every VRAM expert
    flagged, launches told `tiled`; three passes (cold, warm, consolidated: VRAM slots filled and refilled, the third
    reading VRAM, host and disk experts in one layer), 3 decode steps and 2 batched steps of two sequences
    (decode_batch) bit-identical to tile_experts off, both within
    float32 noise of the torch engine, its greedy tokens. Fails with the launches not told (the kernels read a tiled
    expert at its GGUF addresses), the slots left GGUF under the flag, or a wrong tile. Q4_K: ~25 s here (slow)."""
    pytest.importorskip("triton")
    r = _engine_check(tmp_path, qtype)
    assert r["bit_identical"], r
    L = r["n_layer"]
    assert r["on"]["layers_tiled"] == L and r["on"]["kern_tiled"] == [True] * L, r
    assert r["on"]["flagged"] == r["on"]["vram_experts"] > 0 and r["off"]["flagged"] == 0, r
    assert r["tiled_launches"] > 0 and r["reads"][2]["vram"] > 0 and r["reads"][2]["host"] > 0, r
    assert r["max_abs_vs_torch"] <= 1e-4 * r["max_logit"] and r["decode_max_abs_vs_torch"] <= 1e-4 * r["max_logit"], r
    assert r["greedy_equal_torch"], r
