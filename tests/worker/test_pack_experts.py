"""engine.pack_experts (issue 23, docs/benchmarks/cpu-vram62) and engine.tile_experts (cpu-tile63): the VRAM slots hold
their experts in kernels/mma_pack's layout or kernels/tile_layout's tiles, relaid as they fill (ExpertCache._own),
flagged by bit 0 of their base offset (the kernels' PK 2 / `tiled` read each expert's layout from it); host slots and
the ring stay GGUF. On the CPU the layouts are forced on an ExpertCache (set_layouts: what MoEStep calls once the
startup checks passed, which packing's cannot here: no Gluon); the bits of the packed kernel are the device's to check
(deploy/device/check_cuda.py with CHECK_PACK_EXPERTS=1), the tiled one's run here too
(tests/worker/test_tile_experts.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_helpers import ENGINE_SPEC, WIDE_SPEC, close_runner, in_process_runner, write_ds4_tiny, write_synth
from gguf import GGUFReader

from betelgeuse.errors import BetelgeuseError
from betelgeuse.kernels import mma_pack, tile_layout
from betelgeuse.store.directory import ENTRY_DTYPE, TIER_DISK, TIER_VRAM
from betelgeuse.store.plan import vram_needs
from betelgeuse.worker.expert_cache import GGUF, PACKED, TILED, ExpertCache

PARTS = ("gate", "up", "down")


def _file_parts(path) -> dict:
    """(layer, part) -> the merged expert tensor's bytes [E, rows, row_bytes], read by gguf-py's GGUFReader (not the
    engine's reader): the independent reference of what a slot must hold."""
    r = GGUFReader(str(path))
    return {(int(t.name.split(".")[1]), PARTS.index(t.name.split(".")[2][4:-5])): np.asarray(t.data)
            for t in r.tensors if t.name.endswith("_exps.weight")}


def _snap(L: int, E: int, vram: dict[int, int]) -> np.ndarray:
    """A directory snapshot: in every layer the experts of `vram` VRAM-tier (value: its host slot, -1 none), the
    rest on disk."""
    s = np.zeros((L, E), dtype=ENTRY_DTYPE)
    s["tier"], s["host_slot"] = TIER_DISK, -1
    for e, h in vram.items():
        s["tier"][:, e], s["host_slot"][:, e] = TIER_VRAM, h
    return s


# Q4_K (cpu-packk62): K a multiple of 256 (gate/up [512, 256]: 8 tiles, 1 super-block a row; down [256, 512]: 4
# tiles, 2 super-blocks a row, which the tile layout moves)
Q4_K_SPEC = {**WIDE_SPEC, "n_embd": 256, "head_dim": 64, "n_ff_exp": 512, "qtype": "Q4_K"}
# MXFP4 (cpu-mxpk63): ds4-tiny (deepseek4, MXFP4 routed experts) with 3 layers (one hash layer, one sliding) and its
# experts 64 wide (its 32 is not a whole tile): gate/up [64, 64], down [64, 64], 1 tile, 1 K step
MXFP4_SPEC = {"n_layer": 3, "n_hash_layers": 1, "n_ff_exp": 64, "n_embd": 64, "seed": 3}


@pytest.mark.parametrize("spec,qt", [(WIDE_SPEC, 0), (Q4_K_SPEC, 5), (MXFP4_SPEC, 4)], ids=["Q8_0", "Q4_K", "MXFP4"])
def test_relaid_vram_slots_hold_each_experts_file_bytes_in_their_layout(tmp_path, spec, qt):
    """Layer 0 packed, layer 1 GGUF, layer 2 tiled (set_layouts: one scratch for both); VRAM slots filled from host
    slots (sync_vram) and from staging slots (fill_vram), then evictions and re-fills into the freed slots: after each
    round every VRAM expert's parts, unpacked (mma_pack.unpack) in the packed layer, untiled (tile_layout.untile) in
    the tiled one and as they are in the other, equal the file's bytes (gguf-py), a relaid slot's differ from them
    (relaid in place), its base offset has bit 0 set (host table and device table alike), a GGUF one's not; host
    slots keep GGUF order. Fails without the relayout (_own), with it from the slot itself instead of the scratch (the
    gather reads bytes it already overwrote), with a layer's layout swapped for the other, or with the flag left off.
    Q8_0 (WIDE_SPEC) and Q4_K models (mma_pack's Q4_K layout: betelgeuse synth's Q4_K experts), and a deepseek4
    model's MXFP4 experts (mma_pack's MXFP4 layout: ds4-tiny's)."""
    path = (write_ds4_tiny(tmp_path / "w.gguf", **{k: v for k, v in spec.items() if k != "n_embd"}) if qt == 4 else
            write_synth(tmp_path / "w.gguf", **spec))
    ref = _file_parts(path)
    rn, st = in_process_runner(path, 4, 8)
    try:
        s = rn.session
        cache = ExpertCache(s.plan, s.cache.arena, s.file, torch.device("cpu"), torch.float32, ring_slots=2)
        L, E, V = s.plan.n_layer, s.plan.n_expert, s.plan.n_vram
        assert (L, V) == (3, 4)
        layouts = np.array([PACKED, GGUF, TILED])
        cache.set_layouts(layouts)
        assert {mma_pack.GGML[int(m.qtype)] for ps in cache.parts[0] for m in ps} == {qt}
        assert set(cache._pack_index) == {(spec["n_embd"], qt), (spec["n_ff_exp"], qt)}   # gate/up's K, down's K
        on, off = (vram_needs(s.file, replace(rn.cfg, pack_experts=p), cache.slot_bytes, 1)["ring"]
                   for p in (True, False))          # the plan counts what set_layouts put on the device
        assert on - off == cache._scratch.nbytes + sum(i.nbytes for i in cache._pack_index.values())

        def slot_bytes(l, e) -> torch.Tensor:       # a slot holding expert e of layer l as the store lays it out
            out = torch.zeros(cache.slot_bytes, dtype=torch.uint8)
            for k, m in enumerate(cache.parts[l][e]):
                out[m.start: m.start + m.nbytes] = torch.from_numpy(ref[l, k][e].reshape(-1).copy())
            return out

        def fill(vram: dict[int, int]):
            for e, h in vram.items():               # the backed experts' bytes in their host slots (written
                if h >= 0:                          # through the store's mapping: the worker's is read-only)
                    for l in range(L):
                        st.arena.numpy(cache.layout.host_slot_offset(l, h), cache.slot_bytes)[:] = slot_bytes(l, e)
            held = set(np.nonzero(cache.vram_index[0] >= 0)[0].tolist())
            snap = _snap(L, E, vram)
            copied, missing = cache.sync_vram(snap)
            new = [e for e in vram if e not in held]
            assert copied == L * sum(vram[e] >= 0 for e in new) and len(missing) == L * sum(vram[e] < 0 for e in new)
            for l, e, j in missing:                 # the rest through a staging slot
                cache.fill_vram(l, e, j, slot_bytes(l, e), snap)
            cache.fill_done()
            check(vram)

        def check(vram: dict[int, int]):
            assert torch.equal(cache.vram_base_dev, torch.from_numpy(cache.vram_base))
            for l in range(L):
                assert sorted(np.nonzero(cache.vram_index[l] >= 0)[0].tolist()) == sorted(vram)
                for e in vram:
                    j, base = int(cache.vram_index[l, e]), int(cache.vram_base[l, e])
                    assert base & 1 == int(layouts[l] != GGUF) and base & ~1 == (l * V + j) * cache.slot_bytes, \
                        (l, e, base)
                    slot = cache.vram[l, j]
                    for k, m in enumerate(cache.parts[l][e]):
                        got = slot[m.start: m.start + m.nbytes].numpy()
                        want = ref[l, k][e].reshape(-1)
                        if layouts[l] == PACKED or (layouts[l] == TILED and m.shape[1] > tile_layout.unit(m.qtype)[0]):
                            assert not np.array_equal(got, want), (l, e, k)     # relaid in place (a one-block row
                                                                                # tiles to GGUF's own order)
                        if layouts[l] == PACKED:
                            got = mma_pack.unpack(got, *m.shape, qt)
                        elif layouts[l] == TILED:
                            got = tile_layout.untile(got, *m.shape, int(m.qtype))
                        assert np.array_equal(got, want), (l, e, k, m.shape)
                    h = vram[e]
                    if h >= 0:                      # the host slot stays GGUF
                        assert torch.equal(cache.host_slot(l, h), slot_bytes(l, e))

        fill({0: 0, 1: 1, 2: -1, 3: -1})            # 2 from host slots, 2 through staging
        fill({1: 1, 3: -1, 4: 2, 5: -1})            # 0 and 2 evicted; 4 and 5 into their slots
        fill({0: 0, 1: 1, 2: -1, 5: -1})            # 0 and 2 back into the slots of 3 and 4
    finally:
        close_runner(rn, st)


def _parts(shapes, qtypes):
    """ExpertCache.parts' stand-in: one layer a (shapes, qtypes) pair, one expert (pack_check reads expert 0)."""
    return [[[SimpleNamespace(shape=sh, qtype=q) for sh, q in zip(shapes, qts)]] for qts in qtypes]


def test_pack_check_refuses_what_another_kernel_would_read():
    """MoEKernels.pack_check: no Q8_0, MXFP4 or Q4_K expert -> no layer packs and no refusal; a layer mixing those
    with another type, a Q8_0 / MXFP4 part whose rows or K is not a multiple of 64 (Q4_K: K of 256), the torch
    kernels, act_quant off or q8_1, Q4_K under auto (its float schedule), and (the CPU, the interpreter) gluon_mmq's
    form not runnable here -> ValueError naming it. MXFP4 (cpu-mxpk63) reaches that last check under bf16 and auto
    alike (a packed launch is GL 1, triton_mmq.config). Fails with any
    of the refusals dropped."""
    from betelgeuse.kernels.moe import MoEKernels
    starts = torch.zeros((2, 1, 3), dtype=torch.int64)
    sq = [(128, 64), (128, 64), (64, 128)]                  # gate / up [F 128, H 64], down [H, F]

    def kern(backend="triton", act_quant="bf16"):
        return MoEKernels(backend, 1, 128, starts, [(8, 8), (8, 8)], 16, act_quant=act_quant)

    none = kern().pack_check(_parts(sq, [(1, 1, 1), (14, 14, 14)]), 4096, torch.device("cpu"))   # F16, Q6_K
    assert none.tolist() == [False, False]
    with pytest.raises(ValueError, match="layer 1 mixes Q8_0 / MXFP4 / Q4_K .*its types \\[8, 14\\]"):
        kern().pack_check(_parts(sq, [(8, 8, 8), (8, 8, 14)]), 4096, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"type 8 and shape \(96, 64\).*multiple of 64"):
        kern().pack_check(_parts([(96, 64), (96, 64), (64, 96)], [(8, 8, 8)] * 2), 4096, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"type 39 and shape \(128, 32\).*64 \(Q8_0, MXFP4\)"):   # MXFP4: K 64s
        kern().pack_check(_parts([(128, 32), (128, 32), (32, 128)], [(39, 39, 39)] * 2), 4096, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"type 12 and shape \(128, 64\).*256 \(Q4_K\)"):  # Q4_K: K 256s
        kern().pack_check(_parts(sq, [(8, 8, 8), (12, 12, 12)]), 4096, torch.device("cpu"))
    s256 = [(256, 256)] * 3
    with pytest.raises(ValueError, match=r"act_quant = 'auto', GGML types \[12\] off it"):    # Q4_K's float form
        kern(act_quant="auto").pack_check(_parts(s256, [(12, 12, 12), (8, 8, 8)]), 4096, torch.device("cpu"))
    with pytest.raises(ValueError, match="kernels: torch"):
        kern("torch").pack_check(_parts(sq, [(8, 8, 8)] * 2), 4096, torch.device("cpu"))
    for aq in ("off", "q8_1"):
        with pytest.raises(ValueError, match=f"act_quant = '{aq}'"):
            kern(act_quant=aq).pack_check(_parts(sq, [(8, 8, 8)] * 2), 4096, torch.device("cpu"))
    pytest.importorskip("triton")
    for aq in ("bf16", "auto"):
        for qts in ([(8, 8, 8)] * 2, [(39, 39, 39)] * 2, [(39, 39, 39), (8, 8, 39)]):    # Q8_0, MXFP4, a mix
            with pytest.raises(ValueError, match="gluon_mmq's kernel cannot run here"):
                kern(act_quant=aq).pack_check(_parts(sq, qts), 4096, torch.device("cpu"))
    with pytest.raises(ValueError, match="act_quant = 'q8_1'"):
        kern(act_quant="q8_1").pack_check(_parts(sq, [(39, 39, 39)] * 2), 4096, torch.device("cpu"))
    with pytest.raises(ValueError, match="gluon_mmq's kernel cannot run here"):     # Q4_K beside Q8_0: bf16 alone
        kern().pack_check(_parts(s256, [(12, 12, 12), (8, 8, 12)]), 4096, torch.device("cpu"))


def test_startup_refuses_on_the_cpu_and_a_model_without_q8_0_packs_nothing(tmp_path, caplog):
    """engine.pack_experts on the CPU: the runner refuses at attach, naming the setting and why (the torch kernels);
    on a model with no Q8_0 expert it starts, logs that there is nothing to pack, and its plan holds no scratch. A Q8_0
    model's plan counts the repack scratch (one slot more VRAM, in the ring's part). Fails without the refusal
    (MoEStep._pack) or with the scratch left out of the plan."""
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.reader import GGUFModelFile
    q8 = write_synth(tmp_path / "q8.gguf", **ENGINE_SPEC)
    with pytest.raises(BetelgeuseError, match="engine.pack_experts = true: .*kernels: torch"):
        in_process_runner(q8, 2, 3, pack_experts=True)
    f16 = write_synth(tmp_path / "f16.gguf", **{**ENGINE_SPEC, "qtype": "F16"})
    with caplog.at_level(logging.INFO, logger="betelgeuse.worker"):
        rn, st = in_process_runner(f16, 2, 3, pack_experts=True)
    try:
        assert rn.session.cache.layouts is None and rn.session.cache._scratch is None
        assert any(r.getMessage() == "pack_experts" and r.fields["layers"] == 0 and "no Q8_0" in r.fields["why"]
                   for r in caplog.records)
    finally:
        close_runner(rn, st)
    for path, extra in ((q8, 4096 + 8 * 64 * 68), (f16, 0)):       # a slot; K 64's index: 64 rows x 68 bytes int64
        f = GGUFModelFile.open(path)
        on, off = (vram_needs(f, EngineConfig(model_path=str(path), pack_experts=p), 4096, 1)["ring"]
                   for p in (True, False))
        assert on - off == extra, (path, on, off)
