"""engine.group_graphs (worker/group_graphs.py; issue 21): a decode miss layer's eager expert groups replay a CUDA graph
per (Routing, layer, pool, table row) instead of launching gate_up + down.

The CPU has no CUDA graphs, so here:
  - the setting: default off, on from a flag / environment / TOML, a bad value one clear error
  - on the CPU it is a no-op: MoEStep makes no GroupGraphs, and a static-form decode with misses (ds4-tiny, few slots,
    host experts banked) gives the same logits bit for bit with it on and off (guards the plumbing)
  - the memo's decisions, with the triton kernels under TRITON_INTERPRET=1 and a stand-in for the capture whose graph
    re-runs the captured launches with the captured arguments on replay (what a CUDA graph's kernel nodes hold): a
    decode-like sequence (one Routing rewritten in place each step, as a replayed decode graph does; groups over two
    table rows of alternating contents; a flex-chunk-like second pool) launches at a key's first sighting, captures at
    its second and replays after, and every step's output equals the torch reference backend on the same bytes (and,
    bit for bit, the triton launches with no memo). A key missing the table row or the pool would replay another
    group's launches: the reference check fails. A Routing that differs in one tensor never replays another's
    graph, a group applied inside a capture launches, and the memo holds at most `cap` keys.
What only the device can check (deploy/device/group_graph.py, decode_host.py --group-graphs): real capture and
replay, bit-identity there, the host us saved, the shared workspace and memory pool.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from betelgeuse.config import EngineConfig  # noqa: E402
from betelgeuse.errors import BetelgeuseError  # noqa: E402
from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts  # noqa: E402
from engine_helpers import write_ds4_tiny  # noqa: E402


def test_setting_parses_and_refuses_bad_values():
    import argparse
    from betelgeuse.settings import add_flags, flag_values, resolve_settings
    assert EngineConfig(model_path="m.gguf").group_graphs is False
    assert EngineConfig(model_path="m.gguf", group_graphs=True).group_graphs is True
    with pytest.raises(BetelgeuseError, match="group_graphs: expected true or false"):
        EngineConfig(model_path="m.gguf", group_graphs="sometimes")
    p = argparse.ArgumentParser()
    add_flags(p, sections=["engine"])
    r = resolve_settings(None, env={}, flags=flag_values(p.parse_args(["--group-graphs"])))
    assert r.settings.engine.group_graphs is True and r.sources[("engine", "group_graphs")] == "flag --group-graphs"
    r = resolve_settings(None, env={}, flags=flag_values(p.parse_args(["--no-group-graphs"])))
    assert r.settings.engine.group_graphs is False
    r = resolve_settings(None, env={"BETELGEUSE_ENGINE_GROUP_GRAPHS": "true"})
    assert r.settings.engine.group_graphs is True
    with pytest.raises(BetelgeuseError, match=r"BETELGEUSE_ENGINE_GROUP_GRAPHS.*expected true or false"):
        resolve_settings(None, env={"BETELGEUSE_ENGINE_GROUP_GRAPHS": "often"})


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return write_ds4_tiny(tmp_path_factory.mktemp("group_graphs") / "ds4.gguf", expert_qtype="Q8_0", seed=2)


def _decode(path, on: bool, steps: int = 6):
    """A prompt prefilled and settled, then `steps` greedy exact-routed decode steps in the static form (SoloDecode
    through forward(), eager on the CPU) with 2 VRAM + 2 host slots: decode layers miss (disk experts, banked host
    ones) -> (logits [steps, V], the miss layers' eager groups, whether MoEStep made a GroupGraphs)."""
    from engine_helpers import close_runner, in_process_runner, prompt
    rn, st = in_process_runner(path, 2, 2, group_graphs=on, host_in_place="never", decode_consolidate_every=0)
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(prompt(20, rn.mcfg.n_vocab, seed=7), kv)
        rn.settle()
        rn._static_decode = True
        tok, outs, groups = int(lg[-1].argmax()), [], 0
        for _ in range(steps):
            lg, s = rn.forward([tok], kv, consolidate=False)
            outs.append(lg.reshape(-1))
            tok = int(lg[-1].argmax())
            groups += sum(ls.groups - 1 for ls in s.layers if ls.disk or ls.host)
        return torch.stack(outs), groups, rn.moe.group_graphs is not None
    finally:
        close_runner(rn, st)


def test_on_the_cpu_it_is_a_no_op_and_decode_is_bit_identical(ds4):
    off, groups, made_off = _decode(ds4, False)
    on, _, made_on = _decode(ds4, True)
    assert not made_off and not made_on                   # the CPU: no graphs, the kernels launch as before
    assert groups > 0                                     # miss layers ran eager groups: the plumbing was crossed
    assert torch.equal(on.view(torch.int32), off.view(torch.int32))


# ---- the memo's decisions (triton kernels interpreted, a stand-in capture) ----------------------------------------
E, H, F, K = 8, 64, 32, 3


class _Graph:
    """A CUDA graph's stand-in: replay() runs the captured launches again with the arguments they were captured with
    (a kernel node's pointers and ints; the tensors' contents are read at replay time, as on the device)."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()

    def pool(self):
        return None


@pytest.fixture
def memo(monkeypatch):
    pytest.importorskip("triton")
    from betelgeuse.worker import group_graphs as gg
    captured = []

    def capture(pool, fn):
        g = _Graph(fn)
        captured.append(g)
        g.replay()                      # graphs.capture replays once: the capture itself runs nothing
        return g, None
    capturing = [False]
    monkeypatch.setattr(gg, "capture", capture)
    monkeypatch.setattr(gg, "on_side", lambda device, fn: fn())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    return gg, captured, capturing


def _experts(seed=0):
    from gguf import quants as gq
    from gguf.constants import GGMLQuantizationType as GT
    rng = np.random.default_rng(seed)
    raw, deq = [], []
    for _ in range(E):
        parts = [gq.quantize(rng.standard_normal(s).astype(np.float32), GT.Q8_0).reshape(-1)
                 for s in ((F, H), (F, H), (H, F))]
        raw.append([torch.from_numpy(p) for p in parts])
        deq.append([torch.from_numpy(gq.dequantize(p.reshape(s[0], -1), GT.Q8_0))
                    for p, s in zip(parts, ((F, H), (F, H), (H, F)))])
    return raw, deq


def test_memo_launches_captures_replays_and_matches_the_reference(memo):
    gg, captured, capturing = memo
    raw, deq = _experts()
    pool, starts, base, slot = pack_experts(lambda e: raw[e], range(E), E, "cpu")
    # a second pool tensor (a flex chunk's place), its experts packed in the other order: other offsets
    pool2, _, base2, _ = pack_experts(lambda e: raw[e], range(E - 1, -1, -1), E, "cpu")
    assert (base2 != base).any()
    tri = MoEKernels("triton", E, F, starts[None], [(8, 8)], 16)
    ref = MoEKernels("torch", E, F, starts[None], [(8, 8)], 16, weights_fn=lambda b, l, e: deq[e])
    graphs = gg.GroupGraphs(tri, max_rows=2)
    rows = [torch.full((E,), -1, dtype=torch.int64) for _ in range(2)]     # two fixed table rows (the ring's)
    rng = np.random.default_rng(1)
    r = None
    for step in range(5):
        h = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32))
        ids = torch.from_numpy(np.sort(rng.choice(E, K, replace=False))[None].astype(np.int64))
        w = torch.from_numpy(rng.random((1, K)).astype(np.float32))
        fresh = tri.route(h, ids, w)
        if r is None:
            r = fresh
        else:                                             # a replayed decode graph rewrites its Routing in place
            for name in ("h", "ids", "w", "rows", "off", "counts"):
                getattr(r, name).copy_(getattr(fresh, name))
        # three groups, one routed expert each: row 0 over pool, row 1 over pool (another table row), row 0 over
        # pool2 (another pool); the rows' contents change every step (the experts differ). A key without the table
        # row or the pool would replay the first group's launches for the second or third
        e0, e1, e2 = (int(x) for x in ids[0])
        groups = ((rows[0], e0, pool, base), (rows[1], e1, pool, base), (rows[0], e2, pool2, base2))
        for row, e, p, b in groups:
            row.fill_(-1)
            row[e] = int(b[e])
            graphs.apply(r, 0, p, Group(None, row.numpy().copy(), row), slot)
        out = tri.combine(r)
        # the references on the same inputs: the torch backend, and the triton launches with no memo
        rr = ref.route(h, ids, w)
        ref.apply(rr, 0, pool, Group(None, np.where(np.isin(np.arange(E), [e0, e1, e2]), base, -1), None), slot)
        want = ref.combine(rr)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        rt = tri.route(h, ids, w)
        for _, e, p, b in groups:
            tri.apply(rt, 0, p, Group(None, None, torch.from_numpy(np.where(np.arange(E) == e, b, -1))), slot)
        assert torch.equal(out, tri.combine(rt)), step
    # 3 keys: step 0 launches them, step 1 captures them (the capture replays once), steps 2-4 replay
    assert (graphs.launches, graphs.captures, graphs.replays) == (3, 3, 9), graphs.stats()
    assert len(captured) == 3 and all(g.replays == 4 for g in captured)
    # a Routing that differs in one tensor alone (y elsewhere) never replays the other's graph: launched, its own y
    # written, the other's left alone (a key without y's address would replay r's launches into r.y)
    r.y.zero_()
    r2 = dataclasses.replace(r, y=torch.zeros_like(r.y))
    g = Group(None, None, rows[0])
    rows[0].fill_(-1)
    rows[0][e0] = int(base[e0])
    graphs.apply(r2, 0, pool, g, slot)
    assert graphs.launches == 4 and graphs.replays == 9
    assert not r.y.any() and r2.y.any()
    tri.apply(rt, 0, pool, g, slot)
    assert torch.equal(r2.y, rt.y.masked_fill(r2.y == 0, 0))
    # inside a capture (a layer wholly in VRAM in a decode graph) a group launches: the enclosing graph captures it
    capturing[0] = True
    graphs.apply(r, 0, pool, g, slot)
    assert graphs.launches == 5 and graphs.replays == 9
    capturing[0] = False
    # rows beyond max_rows (prefill) launch and are not remembered
    big = tri.route(torch.zeros((3, H)), torch.zeros((3, K), dtype=torch.int64), torch.zeros((3, K)))
    n = len(graphs._memo)
    graphs.apply(big, 0, pool, g, slot)
    assert graphs.launches == 6 and len(graphs._memo) == n
    # bounded: the least recently used key goes first
    graphs.cap = 2
    graphs.apply(r2, 0, pool2, g, slot)
    assert len(graphs._memo) == 2


def test_memo_keys_an_act_quant_routing_whose_prepared_input_holds_none(memo):
    """act_quant bf16 (and auto, which takes it for Q8_0): route() prepares h as prepare_bf16's (x, None, sums), so
    the key's addresses of r.hq skip the None (gpu-run57: `'NoneType' object has no attribute 'data_ptr'` in every
    pool case with --act-quant auto and --group-graphs). One Routing met three times launches, captures, replays,
    each output the memo-less launches' bits."""
    gg, captured, _ = memo
    raw, _ = _experts(3)
    pool, starts, base, slot = pack_experts(lambda e: raw[e], range(E), E, "cpu")
    tri = MoEKernels("triton", E, F, starts[None], [(8, 8)], 16, act_quant="bf16")
    graphs = gg.GroupGraphs(tri, max_rows=2)
    rng = np.random.default_rng(4)
    h = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32))
    ids = torch.from_numpy(np.sort(rng.choice(E, K, replace=False))[None].astype(np.int64))
    w = torch.from_numpy(rng.random((1, K)).astype(np.float32))
    r = tri.route(h, ids, w)
    assert r.hq is not None and any(x is None for x in r.hq), r.hq          # the case the key must take
    row = torch.full((E,), -1, dtype=torch.int64)
    row[ids[0]] = torch.from_numpy(base)[ids[0]]
    rt = tri.route(h, ids, w)
    tri.apply(rt, 0, pool, Group(None, None, row.clone()), slot)
    want = tri.combine(rt)
    for step in range(3):
        r.y.zero_()
        graphs.apply(r, 0, pool, Group(None, row.numpy().copy(), row), slot)
        assert torch.equal(tri.combine(r), want), step
    assert (graphs.launches, graphs.captures, graphs.replays) == (1, 1, 1), graphs.stats()
    assert len(captured) == 1


def test_a_capture_after_the_bound_dropped_every_graph_starts_a_new_pool(memo, monkeypatch):
    """torch frees a graph pool when the last graph captured in it goes; capturing into the freed pool's id fails the
    caching allocator's `use_count > 0` assert (gpu-run60: check_cuda's pp with group graphs, the standard
    schedule's prefill routings each at new addresses, so the LRU bound dropped every graph). The stand-in capture
    keeps torch's rule: a pool named must still hold a live graph. One key captured, then new keys (each a first
    sighting) push it out; the next capture must start a new pool (without the memo's graph count it names the dead
    one and the stand-in raises, as torch does)."""
    import weakref
    gg, _, _ = memo
    live: dict = {}                         # pool token -> its live graphs (weak: a graph dropped by the memo goes)

    class Graph(_Graph):
        def pool(self):
            return self.token

    def capture(pool, fn):
        if pool is not None and not len(live.get(pool, ())):
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        g = Graph(fn)
        g.token = pool if pool is not None else object()
        live.setdefault(g.token, weakref.WeakSet()).add(g)
        g.replay()
        return g, None
    monkeypatch.setattr(gg, "capture", capture)
    raw, _ = _experts(5)
    pool, starts, base, slot = pack_experts(lambda e: raw[e], range(E), E, "cpu")
    tri = MoEKernels("triton", E, F, starts[None], [(8, 8)], 16)
    graphs = gg.GroupGraphs(tri, max_rows=2, cap=2)
    row = torch.full((E,), -1, dtype=torch.int64)
    row[:K] = torch.from_numpy(base)[:K]
    ids = torch.arange(K)[None]
    w = torch.full((1, K), 1.0 / K)

    def routing(seed):
        return tri.route(torch.from_numpy(np.random.default_rng(seed).standard_normal((1, H)).astype(np.float32)),
                         ids, w)
    first = routing(0)
    for _ in range(2):                      # launch, capture: one graph in a new pool
        graphs.apply(first, 0, pool, Group(None, None, row), slot)
    assert graphs.stats()["graphs"] == 1
    others = [routing(s) for s in (1, 2)]   # two first sightings: the bound (2 keys) drops the graph
    for r in others:
        graphs.apply(r, 0, pool, Group(None, None, row), slot)
    assert graphs.stats()["graphs"] == 0 and not any(len(v) for v in live.values())
    graphs.apply(others[1], 0, pool, Group(None, None, row), slot)       # its second sighting: captured
    assert graphs.stats() == {"replays": 0, "captures": 2, "launches": 3, "graphs": 1}, graphs.stats()
    want = tri.route(others[1].h, ids, w)
    tri.apply(want, 0, pool, Group(None, None, row), slot)
    assert torch.equal(tri.combine(others[1]), tri.combine(want))


class _CountingGraphs:
    """What the bench reads of a GroupGraphs: its stats(). Each apply launches (the CPU has no graphs) and counts
    as a replay, so the bench's decode record must count exactly the eager groups the steps ran."""

    def __init__(self, kern):
        self.kern, self.replays = kern, 0

    def apply(self, r, layer, pool, g, slot_bytes):
        self.replays += 1
        self.kern.apply(r, layer, pool, g, slot_bytes)

    def stats(self) -> dict:
        return {"replays": self.replays, "captures": 0, "launches": 0, "graphs": 1}


def test_bench_decode_record_counts_the_group_graphs_of_its_timed_steps(ds4):
    """services/bench: the decode record's group_graphs is what the timed steps did (a delta of stats(), not the
    attachment's totals), and the host split's cell names it; None where the engine made no GroupGraphs."""
    from engine_helpers import close_runner, in_process_runner, prompt
    from services.bench.harness import BenchOptions, Harness
    from services.bench.report import _host_split
    rn, st = in_process_runner(ds4, 2, 2, host_in_place="never", decode_consolidate_every=0)
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(prompt(20, rn.mcfg.n_vocab, seed=7), kv)
        rn.settle()
        rn._static_decode = True
        h = Harness(BenchOptions(model=str(ds4), engine=rn.cfg, decode=4), {}, lambda final: None)
        assert h._decode(rn, kv, lg)["group_graphs"] is None
        rn.moe.group_graphs = gg = _CountingGraphs(rn.moe.kern)
        gg.replays = 1000                                     # before the timed steps: not theirs
        d = h._decode(rn, kv, lg)
    finally:
        close_runner(rn, st)
    assert d["group_graphs"] == {"replays": gg.replays - 1000, "captures": 0, "launches": 0, "graphs": 1}
    assert d["group_graphs"]["replays"] > 0                  # the steps missed: eager groups ran through it
    assert f"group graphs: {gg.replays - 1000:,} replays, 0 captures, 0 launches" in _host_split(d)
