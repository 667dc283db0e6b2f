"""A new sequence replays the decode graphs captured over a recycled state (issue 21: the first two decode tokens of a
request ran eagerly, then captured), on the CPU with a stand-in capture.

ModelRunner.new_cache hands a new sequence a released state of its size (parked with its graphs, reset to a fresh
state's bits in the same tensors): its lane's attention graphs (worker/lanes.py) and its solo step's graphs
(worker/decode_graphs.py) are keyed on the state's uid, which it keeps. On the CPU no graph runs: the stand-in capture
runs the captured function once (as graphs.capture's replay-once does) and its replay runs it again, its outputs
copied into the captured ones (a graph's outputs stay at their addresses). The lanes' bits are checked against a
fresh process (a stale length or state row would change them); the CUDA replay itself is the device's to check.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from betelgeuse.worker import decode_graphs, graphs, lanes

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, write_ds4_tiny, write_synth

STEPS = 4


def _copy_into(dst, src):
    """src's tensors into dst's, in place (tuples, lists and dataclasses walked; other fields rebound)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            d, s = getattr(dst, f.name), getattr(src, f.name)
            if isinstance(d, (torch.Tensor, tuple, list)) or dataclasses.is_dataclass(d):
                _copy_into(d, s)
            else:
                setattr(dst, f.name, s)


class _Graph:
    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        new = self.fn()             # a solo segment's generator is spent by then: None (its replay runs nothing)
        if new is not None:
            _copy_into(self.out, new)

    def pool(self):
        return None


@pytest.fixture
def captured(monkeypatch):
    """Every capture of the lanes and of SoloDecode, in order (a stand-in for graphs.capture)."""
    made = []

    def capture(pool, fn):
        out = fn()
        made.append(_Graph(fn, out))
        graphs.CAPTURED[0] += 1         # as graphs.capture counts them
        return made[-1], out
    monkeypatch.setattr(lanes, "capture", capture)
    monkeypatch.setattr(decode_graphs, "capture", capture)
    return made


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("recycle") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    return write_ds4_tiny(tmp_path_factory.mktemp("recycle") / "ds4.gguf", expert_qtype="Q8_0", seed=2)


def _prompts(n_vocab):
    rng = np.random.default_rng(7)
    # the first longer than the second (its state rows past the second's length hold something) and past the
    # deepseek4 window (16) and a compressor window (4)
    return [rng.integers(0, n_vocab, 37).tolist(), rng.integers(0, n_vocab, 21).tolist()]


def _runner(path, recycle: bool, solo_graphs: bool = False):
    rn, st = in_process_runner(path, 2, 3, max_running=2, prefill_chunk=16)
    rn._static_decode = True            # CUDA's form, eagerly on the CPU
    rn.recycle_states = recycle
    rn._lane_set().graphs_on = True     # the graph modes, with the stand-in capture
    rn.solo.graphs_on = solo_graphs
    return rn, st


def _lane_sequences(path, prompts, recycle, captured):
    """Each prompt prefilled and decoded STEPS greedy tokens through the lanes, one after the other, released after
    -> (logits [STEPS, V] per prompt, captures during each one's decode, each one's state)."""
    rn, st = _runner(path, recycle)
    try:
        out, caps, kvs = [], [], []
        for P in prompts:
            kv = rn.new_cache(64)
            if kvs and recycle:         # the released state, back as a fresh one
                assert kv is kvs[-1], "not recycled"
                assert kv.length == 0, kv.length
                assert all(not t.any() for t in (kv.k + kv.v if hasattr(kv, "k") else kv.tensors()))
            kvs.append(kv)
            tok = int(rn.forward(P, kv)[0][-1].argmax())
            n0, rows = len(captured), []
            for _ in range(STEPS):
                lg, _ = rn.decode_batch([tok], [kv])
                rows.append(lg[0])
                tok = int(lg[0].argmax())
            caps.append(len(captured) - n0)
            out.append(torch.stack(rows))
            rn.release(kv)
        return out, caps, kvs
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_second_sequence_replays_and_matches_a_fresh_process(arch, qwen, ds4, captured):
    path = qwen if arch == "qwen3moe" else ds4
    prompts = _prompts(320 if arch == "qwen3moe" else 512)
    fresh, _, _ = _lane_sequences(path, prompts[1:], False, captured)
    got, caps, kvs = _lane_sequences(path, prompts, True, captured)
    assert kvs[1] is kvs[0]
    assert caps[0] > 0 and caps[1] == 0, caps                   # the second sequence captures nothing
    assert torch.equal(got[1], fresh[0]), (got[1] - fresh[0]).abs().max()
    # before: each new sequence's attention graphs were captured from its second step (one per layer)
    _, caps_off, kvs_off = _lane_sequences(path, prompts, False, captured)
    kv = kvs_off[1]
    assert kv is not kvs_off[0] and caps_off[1] == (len(kv.k) if arch == "qwen3moe" else kv.n_layers), caps_off


def test_solo_second_sequence_replays(qwen, captured, monkeypatch):
    """forward()'s decode (SoloDecode: what the bench measures): the recycled state's first step replays; before,
    a new sequence's first step ran eagerly and its second captured. Only the path is checked here (the stand-in
    cannot replay a step's segments); its bits are the device's check."""
    eager = [0]
    ops = decode_graphs.SoloDecode._ops

    def counted(self, *a, **k):
        eager[0] += 1                   # an eager or capturing step runs the ops; a replay does not
        return ops(self, *a, **k)
    monkeypatch.setattr(decode_graphs.SoloDecode, "_ops", counted)
    prompts = _prompts(320)
    for recycle in (True, False):
        rn, st = _runner(qwen, recycle, solo_graphs=True)
        try:
            runs = []
            for P in prompts:
                kv = rn.new_cache(64)
                tok = int(rn.forward(P, kv)[0][-1].argmax())
                e0, c0 = eager[0], len(captured)
                for _ in range(STEPS):
                    lg, _ = rn.forward([tok], kv, consolidate=False)
                    tok = int(lg[-1].argmax())
                runs.append((eager[0] - e0, len(captured) - c0 > 0))
                rn.release(kv)
        finally:
            close_runner(rn, st)
        assert runs[0] == (2, True), runs                           # eager, capture, replay, replay
        assert runs[1] == ((0, False) if recycle else (2, True)), (recycle, runs)


def test_parked_states_stay_within_max_running(qwen):
    """A state of another size drops the oldest parked one: live + parked <= max_running (the plan's count of
    states and graph pools), and the dropped one's bytes go back to the flex cache's room."""
    rn, st = _runner(qwen, True)
    try:
        a, b = rn.new_cache(64), rn.new_cache(64)
        rn.release(a)
        rn.release(b)
        assert len(rn._parked) == 2 and len(rn._kv_live) == 2
        c = rn.new_cache(128)                       # no parked state of 128 tokens: a's dropped, b kept
        assert c is not a and c is not b and list(rn._parked) == [b.uid]
        assert sorted(rn._kv_live) == sorted([b.uid, c.uid])
        assert rn.new_cache(64) is b and not rn._parked
        rn.release(c)
        rn._drop_parked()
        assert list(rn._kv_live) == [b.uid]
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("form", ["lanes", "solo"])
def test_warm_graphs_at_start_make_the_first_request_replay(qwen, captured, monkeypatch, form):
    """ModelRunner.warm_graphs (the start-up capture: two decode steps on a state of the size, released): the first
    sequence of that size then captures nothing and (lanes) its logits equal a run without the warm-up; the store pass
    the warm-up opened is closed (an idle worker holds no pass open)."""
    eager = [0]
    ops = decode_graphs.SoloDecode._ops

    def counted(self, *a, **k):
        eager[0] += 1
        return ops(self, *a, **k)
    monkeypatch.setattr(decode_graphs.SoloDecode, "_ops", counted)
    P = _prompts(320)[1]
    got = {}
    for warm in (True, False):
        rn, st = _runner(qwen, True, solo_graphs=True)
        try:
            if warm:
                w = rn.warm_graphs(64, lanes=form == "lanes")
                assert w is not None and w["captured"] > 0 and w["form"] == form, w
                assert not rn.session.pass_open and len(rn._parked) == 1
            kv = rn.new_cache(64)
            assert (kv.uid in rn._kv_live) and not rn._parked
            tok = int(rn.forward(P, kv)[0][-1].argmax())
            c0, e0, rows = len(captured), eager[0], []
            for _ in range(STEPS):
                lg, _ = rn.decode_batch([tok], [kv]) if form == "lanes" else rn.forward([tok], kv, consolidate=False)
                rows.append(lg[-1])
                tok = int(lg[-1].argmax())
            got[warm] = torch.stack(rows), len(captured) - c0, eager[0] - e0
        finally:
            close_runner(rn, st)
    assert got[True][1] == 0 and got[False][1] > 0, (got[True][1:], got[False][1:])
    if form == "lanes":
        assert torch.equal(got[True][0], got[False][0])
    else:
        assert got[True][2] == 0 and got[False][2] == 2


def test_warm_graphs_is_a_no_op_without_graphs(qwen):
    rn, st = in_process_runner(qwen, 2, 3, max_running=2)
    try:
        assert not rn.recycle_states and rn.warm_graphs(64, lanes=True) is None and not rn._kv_live
    finally:
        close_runner(rn, st)


def test_lanes_park_and_claims():
    """Lanes.park / join: a parked state's lane is claimed for it (a newcomer takes an unclaimed free lane first, else
    the lane parked longest ago, whose graphs go); the state takes its lane and graphs back unless its lane is taken."""
    from types import SimpleNamespace
    m = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                        cfg=SimpleNamespace(n_embd=4, n_head=1, head_dim=4))
    ln = lanes.Lanes(m, 2, 3, graphs=True)

    def kv():
        return SimpleNamespace(uid=object())
    a, b, c, d = kv(), kv(), kv(), kv()
    assert ln.join([a, b]).tolist() == [0, 1]
    sa = ln.seqs[a.uid]
    ln.park(a.uid)
    assert ln.join([b, c]).tolist() == [1, 2]                  # lane 0 is claimed by a: c takes 2
    assert ln.join([b, c, a]).tolist() == [1, 2, 0] and ln.seqs[a.uid] is sa   # a back with its graphs
    ln.park(a.uid)
    ln.join([b, c])
    ln.park(b.uid)                                              # b ran a step after a: a parked longer ago
    assert ln.join([c, d]).tolist() == [2, 0] and a.uid not in ln.parked and b.uid in ln.parked
    assert ln.join([c, d, a]).tolist() == [2, 0, 1] and ln.seqs[a.uid] is not sa and not ln.parked
