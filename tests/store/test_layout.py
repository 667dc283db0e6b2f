"""Slot layout: alignment, capacity, and real GGUF expert slices landing where the layout says.

The reference for the expert bytes is gguf-py's own GGUFReader (tensor.data of the merged
*_exps tensors), not our code."""

import os
import random

import numpy as np
import pytest

from betelgeuse.store.arena import Arena
from betelgeuse.store.layout import PAGE, ArenaLayout, SlotLayout, directory_nbytes
from betelgeuse.store.reader import ExpertReader, fs_type

gguf = pytest.importorskip("gguf")


def test_for_parts_capacity_holds_any_intra_page_offset():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 3 << 20)
        sl = SlotLayout.for_parts((n, n + 7, max(1, n // 3)))
        for r in list(range(0, 64)) + [rng.randrange(PAGE) for _ in range(64)] + [PAGE - 1]:
            off = rng.randrange(0, 1 << 40, PAGE) + r
            span = -(-(off + n) // PAGE) * PAGE - (off - off % PAGE)
            assert span <= sl.part_capacity[0]
        assert all(c % PAGE == 0 for c in sl.part_capacity)
        assert sl.slot_bytes == sum(sl.part_capacity) and sl.slot_bytes % PAGE == 0
    # worst cases by hand: 4096 bytes at intra-page offset 1 span 2 pages; 4097 at 4095 end at 8192
    assert SlotLayout.for_parts((1, 4096, 4097)).part_capacity == (4096, 8192, 8192)


def test_part_places_are_aligned_and_disjoint():
    sl = SlotLayout.for_parts((10_000, 20_000, 5_000))
    places = [sl.part_place(k) for k in range(3)]
    assert places[0] == 0 and all(p % PAGE == 0 for p in places)
    for k in range(3):
        end = places[k] + sl.part_capacity[k]
        assert end <= sl.slot_bytes and (k == 2 or end <= places[k + 1])
    assert sl.part_data(1, 123 * PAGE + 77) == places[1] + 77


def test_arena_layout_regions_disjoint_aligned_and_inside():
    sl = SlotLayout.for_parts((70_000, 70_000, 69_000))
    lay = ArenaLayout(n_layer=5, n_expert=64, host_per_layer=7, n_staging=3, slot=sl)
    assert lay.directory_offset == 0 and lay.directory_bytes >= directory_nbytes(5, 64)
    spans = [(lay.directory_offset, lay.directory_bytes)]
    spans += [(lay.host_slot_offset(l, i), sl.slot_bytes) for l in range(5) for i in range(7)]
    spans += [(lay.staging_slot_offset(i), sl.slot_bytes) for i in range(3)]
    spans.sort()
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a % PAGE == 0 and a + n <= b
    assert spans[-1][0] + spans[-1][1] == lay.total_bytes and lay.total_bytes % PAGE == 0
    assert lay.total_bytes == lay.directory_bytes + (5 * 7 + 3) * sl.slot_bytes
    assert ArenaLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(AssertionError):
        lay.host_slot_offset(0, 7)


def _write_moe_gguf(path, n_layer=3, n_expert=6, hidden=40, ff=24, seed=0):
    """A GGUF with llama.cpp-style merged expert tensors, F32 and F16, with small odd tensors in
    between so that expert offsets are 32-byte but not 4 KiB aligned."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for l in range(n_layer):
        w.add_tensor(f"blk.{l}.attn_norm.weight", rng.standard_normal(hidden + 3 * l + 1).astype(np.float32))
        # numpy shape (n_expert, ne1, ne0): expert e is the contiguous slab [e]
        w.add_tensor(f"blk.{l}.ffn_gate_exps.weight", rng.standard_normal((n_expert, ff, hidden)).astype(np.float32))
        w.add_tensor(f"blk.{l}.ffn_up_exps.weight", rng.standard_normal((n_expert, ff, hidden)).astype(np.float16))
        w.add_tensor(f"blk.{l}.ffn_down_exps.weight", rng.standard_normal((n_expert, hidden, ff)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class _Part:  # the fields of betelgeuse.gguf.reader.ExpertPart that the layout uses
    __slots__ = ("offset", "nbytes")

    def __init__(self, offset, nbytes):
        self.offset, self.nbytes = offset, nbytes


def test_gguf_experts_read_into_slots_match_gguf_reader(tmp_path_factory):
    base = "/var/tmp" if fs_type("/var/tmp") not in ("tmpfs", "overlay") else str(tmp_path_factory.mktemp("g"))
    path = os.path.join(base, f"bg-layout-{os.getpid()}.gguf")
    n_layer, n_expert = 3, 6
    try:
        _write_moe_gguf(path, n_layer, n_expert)
        rd = gguf.GGUFReader(path)
        t = {x.name: x for x in rd.tensors}
        kinds = ("gate", "up", "down")

        def parts(l, e):
            out = []
            for k in kinds:
                x = t[f"blk.{l}.ffn_{k}_exps.weight"]
                per = int(x.n_bytes) // n_expert
                out.append(_Part(int(x.data_offset) + e * per, per))
            return out

        offs = [p.offset % PAGE for l in range(n_layer) for e in range(n_expert) for p in parts(l, e)]
        assert any(o != 0 for o in offs), "test file should have unaligned expert offsets"
        sl = SlotLayout.for_experts(parts(l, 0) for l in range(n_layer))
        lay = ArenaLayout(n_layer, n_expert, host_per_layer=2, n_staging=2, slot=sl)
        with Arena.create(lay.total_bytes) as arena, ExpertReader(path, arena, threads=3, request_bytes=8192) as reader:
            want = {}
            for l in range(n_layer):
                for i, e in enumerate((1, n_expert - 1)):
                    dest = lay.host_slot_offset(l, i)
                    reader.read(sl.read_ranges(parts(l, e), dest)).result(timeout=30)
                    want[(l, i)] = (e, dest)
            for (l, i), (e, dest) in want.items():
                for k, kind in enumerate(kinds):
                    ref = np.ascontiguousarray(t[f"blk.{l}.ffn_{kind}_exps.weight"].data[e]).view(np.uint8).ravel()
                    p = parts(l, e)[k]
                    got = arena.numpy(dest + sl.part_data(k, p.offset), p.nbytes)
                    np.testing.assert_array_equal(got, ref, err_msg=f"layer {l} expert {e} {kind}")
    finally:
        if os.path.exists(path):
            os.unlink(path)
