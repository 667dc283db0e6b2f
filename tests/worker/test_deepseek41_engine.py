"""deepseek41 through the out-of-core engine (runner, slots, store, Engram rows from the store), in one process on
the CPU.

Invariant 1 with the Engram tier: logits bit-identical to the Deepseek41Reference (experts dequantized from the
file's map, Engram rows read from the map) whatever the slot configuration, cold, warm and after consolidation, and
whether the rows came from disk or the store's row cache; decode steps (which carry the n-gram history, the sliding
window, the open compression windows and the shared compressed streams) too. The Engram reads are counted (rows,
disk rows, cache rows, whole 4 KiB pages) and go through the store's own reader (O_DIRECT where the filesystem allows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from betelgeuse.model.deepseek41 import DS41Cache

from engine_helpers import (close_runner, close_to_reference_decode, decode_bit_identical, in_process_runner,
                            lanes_decode, synth_reference, three_passes)

E = 8
PROMPT = [int(x) for x in np.random.default_rng(4).integers(0, 512, 150)]
# prefill chunk of the reference and the runners here: the 150-token prompt spans 3 chunks (deepseek41's default, 256,
# would take it whole; tests/worker/test_prefill_chunk.py runs that one)
CHUNK = 64
CONFIGS = [(0, 0), (2, 3), (E, 0)]


def _model(tmp_path_factory, engram_qtype="Q8_0"):
    return synth_reference(tmp_path_factory, "ds41-tiny", PROMPT, 200, chunk=CHUNK, engram_qtype=engram_qtype, seed=2,
                           engram_key_length=256 if engram_qtype.endswith("_K") else 32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model(tmp_path_factory)


def _all_rows(ref) -> np.ndarray:
    """Every (table, row) of the prompt, as keys: what a cold pass must read once each."""
    rows = ref.hasher.rows(np.zeros(0, np.int64), np.array(PROMPT))           # [T, n_eng, n_cols]
    return (np.arange(rows.shape[1])[None, :, None] << 40) | rows


def _passes(path, want, vram, host, **cfg):
    def check(runner, kv):
        assert type(runner.model).__name__ == "Deepseek41Model" and runner.session.engram is not None
        assert isinstance(kv, DS41Cache)
    return three_passes(path, PROMPT, want, vram, host, 200, check, **{"prefill_chunk": CHUNK, **cfg})


@pytest.mark.parametrize("vram,host", CONFIGS, ids=[f"{v}v{h}h" for v, h in CONFIGS])
def test_logits_bit_identical_across_slots_and_passes(model, vram, host):
    path, ref, want = model
    stats, status = _passes(path, want, vram, host)
    g = ref.q.engram
    cold, warm = stats[0].engram, stats[1].engram
    assert cold.rows == len(PROMPT) * g.n_cols * len(g.layer_ids)          # 150 tokens x 4 columns x 2 layers
    # cold: every distinct row comes from disk at least once (a later sub-batch finds it cached unless the two were
    # in flight together: banks read concurrently do not wait for each other's rows)
    assert 0 < cold.unique_rows <= cold.rows and cold.disk_rows + cold.cache_rows == cold.unique_rows
    assert len(np.unique(_all_rows(ref))) <= cold.disk_rows
    assert cold.disk_bytes > 0 and cold.disk_bytes % 4096 == 0                # whole pages (tests/store/test_engram_store.py)
    assert warm.disk_rows == 0 and warm.cache_rows == warm.unique_rows     # the row cache answers a repeat
    assert status["engram_disk_rows"] == cold.disk_rows and status["engram_read_mode"] in ("direct", "buffered")
    assert stats[0].reads["disk"] > 0


def test_without_row_cache_every_pass_reads_the_disk(model):
    path, _, want = model
    stats, status = _passes(path, want, 2, 3, engram_cache_bytes=0)
    assert all(s.engram.disk_rows == s.engram.unique_rows > 0 for s in stats)
    assert status["engram_cache_capacity"] == 0


@pytest.mark.parametrize("qtype", ["Q4_K", "Q2_K"])
def test_k_quant_tables(tmp_path_factory, qtype):
    """Tables in the K-quants llama.cpp's Q2_K / Q4_K files use (256-value rows = one super-block): the rows the
    store reads are dequantized as gguf-py does, and the engine equals the reference bit for bit."""
    from gguf import quants
    path, ref, want = _model(tmp_path_factory, engram_qtype=qtype)
    t = ref.file.tensors["blk.1.engram_embd.weight"]
    rb = t.nbytes // t.shape[0]
    raw = np.asarray(ref.file.raw(t.name)).reshape(t.shape[0], rb)[[0, 5, t.shape[0] - 1]]
    got = ref.engram_rows.rows(0, np.array([[0, 5, t.shape[0] - 1]])).reshape(3, -1).numpy()
    assert np.array_equal(got, quants.dequantize(raw.copy(), t.qtype).reshape(3, -1))
    _passes(path, want, 2, 3)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decode_bit_identical(model, static):
    """Prefill 120 tokens, then 30 single-token passes; every row equals the reference's decode, whose rows match its
    whole-prompt prefill within float32 noise (the n-gram history crosses the passes). static: the runner's static
    decode (worker/decode_graphs.py SoloDecode, CUDA's form, eagerly here, the Engram rows staged before the layers)
    — the same bits."""
    for steps in decode_bit_identical(model, PROMPT, 120, 3, E - 3, static, prefill_chunk=CHUNK):
        g = steps[-1].engram
        assert g.rows == 8 and g.requests == 1                       # one store round trip per step for both layers


def test_pieces_off_the_chunk_grid_read_the_planned_engram_units(model):
    """A prompt prefilled in pieces that start off the chunk grid (37 + 62 tokens, 16-token chunks): each layer asks
    for its Engram rows chunk by chunk, ENGRAM_TOKENS from each chunk's start, and the feed planned exactly those
    units (none read on its own, one round trip per bank); the logits are the reference's, chunked alike."""
    path, ref, _ = model
    ref.chunk, chunk = 16, ref.chunk
    try:
        kv = ref.new_cache(128)
        with torch.no_grad():
            want = [ref.forward(torch.tensor(PROMPT[a:b]), kv) for a, b in ((0, 37), (37, 99))]
    finally:
        ref.chunk = chunk
    runner, store = in_process_runner(path, 2, 3, prefill_chunk=16)
    try:
        rkv = runner.new_cache(128)
        for (a, b), w in zip(((0, 37), (37, 99)), want):
            logits, st = runner.forward(PROMPT[a:b], rkv, all_logits=True)
            assert torch.equal(logits, w), f"piece {a}..{b}: max |diff| {(logits - w).abs().max():.3e}"
            assert st.engram.unplanned == 0 and st.engram.rows == (b - a) * 4 * 2
    finally:
        close_runner(runner, store)


def test_batched_decode_and_prefill_bit_identical(model):
    """decode_batch (one pass, each expert loaded once, Engram rows of all sequences in one plan) and prefill_batch
    give each sequence the reference's own rows."""
    path, ref, _ = model
    prompts, nxt, want = (PROMPT[:35], PROMPT[40:60]), (7, 9), []
    for p, t in zip(prompts, nxt):
        kv = ref.new_cache(64)
        first = ref.forward(torch.tensor(p), kv)
        want.append((first, ref.forward(torch.tensor([t]), kv)[-1]))
    runner, store = in_process_runner(path, 2, 3)
    try:
        kvs = [runner.new_cache(64) for _ in prompts]
        firsts, _ = runner.prefill_batch([(list(p), kv) for p, kv in zip(prompts, kvs)], all_logits=True)
        logits, st = runner.decode_batch(list(nxt), kvs)
        for i in range(2):
            assert torch.equal(firsts[i], want[i][0]) and torch.equal(logits[i], want[i][1])
        assert st.engram.rows == 2 * 4 * 2 and st.engram.requests == 1
    finally:
        close_runner(runner, store)


def test_lanes_batch_invariant(model):
    """Batched decode in the static form (the lanes: CUDA's batched decode; Engram rows staged into the lanes'
    buffer) crossing ratio-2 windows, the window ring's wrap and the candidate blocks: each sequence's logits
    bit-identical batched or alone and across slot configurations, one Engram store round trip per step, and equal
    to the reference's decode within float noise (row-batched projections may round differently from one-row ones)."""
    path, ref, _ = model
    prompts = [PROMPT[:30], PROMPT[50:63], PROMPT[70:77]]
    alone = lanes_decode(path, prompts, 6, 0, 0, together=False)
    for vram, host in ((0, 0), (E, 0), (2, 3)):
        stats = []
        got = lanes_decode(path, prompts, 6, vram, host, together=True, stats=stats)
        for a, b in zip(alone, got):
            assert torch.equal(a, b), (vram, host, (a - b).abs().max())
        assert all(s.engram.rows == 3 * 4 * 2 and s.engram.requests == 1 for s in stats)
    close_to_reference_decode(ref, prompts, alone)
