"""The solo decode graphs' folded start (MoEStep.hand_fold, issue 21: host time per expert application): each layer's
routing sync copies and event, captured in the layer's graph before its at-hand group, so a replayed step makes one
graph launch and one host part a layer, not two of each.

On the CPU (eager, as the tests force the static form) the fold must be the unfolded path's bits, reads and guesses,
step by step (the unfolded path is itself checked against the partial path, and that one against transformers:
test_decode_at_hand.py, test_decode_static.py), and the step must yield one host part per layer with a miss path;
gpu_marks keeps the unfolded form. The lanes (worker/lanes.py, the engine's decode form) fold the same start and
the at-hand group into each layer's post part (the graph that routes): the same bits, reads and guesses as their
unfolded form, one and two sequences, qwen3moe and deepseek4, with no "hand" part and no host start. On CUDA (skipped
here): a start captured in a graph is written by its replay (the external event waited for), and the graph sync's
buffer is never remade.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_ds4_tiny, write_synth
from betelgeuse.worker import decode_graphs, lanes as lanes_mod, moe_step

V = ENGINE_SPEC["n_vocab"]
GUESS = ("guessed", "guess_hits", "guess_disk")      # (the bytes read ahead depend on the store's timing)
HOST_GUESS = ("host_guessed", "host_guess_hits", "host_guess_bytes")     # copies ahead (prefetch_host)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("fold") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    """ds4-tiny with Q8_0 experts (engine_helpers.write_tiny_pair's)."""
    return write_ds4_tiny(tmp_path_factory.mktemp("fold_ds4") / "ds4.gguf", expert_qtype="Q8_0", seed=2)


def _decode(model, fold: bool, marks: bool = False, steps: int = 6):
    """Greedy solo decode in the static form (a VRAM / host / disk mix, the flex cache on) -> (logits [steps, V],
    per step (reads, flex hits, guess figures), per step the host parts' kinds _ops yielded)."""
    rn, st = in_process_runner(model, 2, 3, decode_consolidate_every=0, flex_cache=True, max_running=2,
                               max_context=1024, staging_slots=6, prefix_cache_bytes=0, read_threads=1,
                               decode_fold=True)
    kinds = []
    ops = decode_graphs.SoloDecode._ops

    def seen(self, *a, **k):
        for item in ops(self, *a, **k):
            kinds[-1].append(item[0])
            yield item
    try:
        assert rn.moe.graph_sync is not None            # the CPU captures nothing: the fold is always possible
        if not fold:
            rn.moe.graph_sync = None
        rn.gpu_marks = marks
        kv = rn.new_cache(64)
        lg, _ = rn.forward(prompt(24, V, seed=5), kv)
        rn.settle()
        rn._static_decode = True
        tok = int(lg[-1].argmax())
        out, stats = [], []
        decode_graphs.SoloDecode._ops = seen
        for _ in range(steps):
            kinds.append([])
            lg, s = rn.forward([tok], kv, consolidate=False)
            out.append(lg.reshape(-1, V)[-1])
            stats.append((dict(s.reads), s.flex_hits, [getattr(s, k) for k in GUESS]))
            tok = int(out[-1].argmax())
        return torch.stack(out), stats, kinds
    finally:
        decode_graphs.SoloDecode._ops = ops
        close_runner(rn, st)


def test_folded_start_is_the_unfolded_paths_bits_reads_and_guesses(model):
    want, want_stats, want_kinds = _decode(model, fold=False)
    got, got_stats, got_kinds = _decode(model, fold=True)
    assert torch.equal(got, want), (got - want).abs().max().item()
    assert got_stats == want_stats
    assert sum(s[2][0] for s in got_stats) > 0, got_stats        # guesses rode on the folded sync
    n = ENGINE_SPEC["n_layer"]
    for k0, k1 in zip(want_kinds, got_kinds):
        assert k0 == ["start", "misses"] * n, k0                 # two host parts a layer: three graphs cut
        assert k1 == ["folded"] * n, k1                          # one: the start in the layer's graph


def test_gpu_marks_keep_the_route_mark_between_the_start_and_the_group(model):
    _, _, kinds = _decode(model, fold=True, marks=True, steps=2)
    assert all("folded" not in k and k.count("start") == ENGINE_SPEC["n_layer"] for k in kinds), kinds


def _lanes(path, n_vocab: int, n: int, fold: bool, steps: int = 4, **cfg):
    """n prompts decoded together through the lanes (decode_batch, the static form, eager on the CPU; max_running 2,
    a VRAM / host / disk mix, the flex cache on) -> (logits [steps, n, V], per step (reads, flex hits, guess
    figures), per step the lane parts run (their names), per step the host's sync starts (graph_sync's, the
    default sync's))."""
    rn, st = in_process_runner(path, 2, 3, **{**dict(decode_consolidate_every=0, flex_cache=True, max_running=2,
                                                     max_context=1024, staging_slots=6, prefix_cache_bytes=0,
                                                     read_threads=1, decode_fold=True), **cfg})
    parts, starts = [], []
    run, post, start = lanes_mod.Lanes._run, lanes_mod.Lanes._post, moe_step.RoutingSync.start
    inside = []                                         # >0 while a post part runs (its graph, on CUDA)

    def seen_run(self, key, *a):
        parts[-1].append(key[0])
        return run(self, key, *a)

    def seen_post(self, *a):
        inside.append(1)
        try:
            return post(self, *a)
        finally:
            inside.pop()

    def seen_start(self, *a):
        starts[-1].append(("graph" if self is rn.moe.graph_sync else "sync", bool(inside)))
        return start(self, *a)
    try:
        assert rn.moe.graph_sync is not None
        if not fold:
            rn.moe.graph_sync = None
        kvs = [rn.new_cache(64) for _ in range(n)]
        toks = [int(rn.forward(prompt(16 + 4 * i, n_vocab, seed=20 + i), kv)[0][-1].argmax())
                for i, kv in enumerate(kvs)]
        rn.settle()
        rn._static_decode = True
        out, stats = [], []
        lanes_mod.Lanes._run, lanes_mod.Lanes._post, moe_step.RoutingSync.start = seen_run, seen_post, seen_start
        for _ in range(steps):
            parts.append([]), starts.append([])
            lg, s = rn.decode_batch(toks, kvs)
            out.append(lg)
            stats.append((dict(s.reads), s.flex_hits, [getattr(s, k) for k in GUESS + HOST_GUESS]))
            toks = [int(x) for x in lg.argmax(-1)]
        hand_layers = int((~rn.cache.all_vram).sum())
        return torch.stack(out), stats, parts, starts, hand_layers
    finally:
        lanes_mod.Lanes._run, lanes_mod.Lanes._post, moe_step.RoutingSync.start = run, post, start
        close_runner(rn, st)


@pytest.mark.parametrize("n", [1, 2], ids=["one-seq", "two-seqs"])
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek4"])
def test_lanes_fold_is_the_unfolded_lanes_bits_reads_and_guesses(model, ds4, arch, n):
    """The lanes' fold (runner._lane_fold, MoEStep.hand_front in post[l]): the unfolded lanes' logits, reads and
    guesses step by step (those are checked against the partial path: test_decode_at_hand.py), every at-hand
    layer's start the graph sync's, inside its post part, and no "hand" part (one lane part and one host part a
    layer fewer). Two sequences' guesses fill more of the graph sync's buffer (sized for max_running rows: a start
    past it raises on every device)."""
    path, V_ = {"qwen3moe": (model, V), "deepseek4": (ds4, 512)}[arch]
    _check_lanes_fold(path, V_, n)


def test_lanes_fold_with_copy_ahead_in_pool_routing(ds4):
    """The same in pool routing with copy ahead (prefetch_host on, host experts banked: test_decode_copy_ahead.py's
    lanes case): layer l's misses copy layer l+1's guessed host experts into a ring bank that post[l+1]'s at-hand
    group then reads."""
    _check_lanes_fold(ds4, 512, 2, routing="pool", prefetch_host="on", host_in_place="never", flex_cache=False,
                      guess_at=len(GUESS) + 1)


def _check_lanes_fold(path, V_, n, guess_at: int = 0, **cfg):
    """guess_at: the guess figure that must be > 0 (GUESS + HOST_GUESS's index: guessed, or host_guess_hits)."""
    want, want_stats, want_parts, want_starts, hands = _lanes(path, V_, n, fold=False, **cfg)
    got, got_stats, got_parts, got_starts, hands_ = _lanes(path, V_, n, fold=True, **cfg)
    assert hands == hands_ > 0
    assert torch.equal(got, want), (got - want).abs().max().item()
    assert got_stats == want_stats
    assert sum(s[2][guess_at] for s in got_stats) > 0, got_stats     # guesses rode on the folded sync
    for i, (p0, p1, s0, s1) in enumerate(zip(want_parts, got_parts, want_starts, got_starts)):
        assert p0.count("hand") == hands and "hand" not in p1, (p0, p1)
        assert [x for x in p0 if x != "hand"] == p1, (p0, p1)
        assert s0 == [("sync", False)] * hands, s0              # a host part between post[l] and the hand part
        # in post[l], the graph that routed (on CUDA the steps from the third replay it: no host call at all)
        assert s1 == [("graph", True)] * hands or (torch.cuda.is_available() and i >= 2 and s1 == []), (i, s1)


def test_the_graph_sync_holds_max_running_rows_of_guesses(model):
    """The graph sync's buffer: a layer's counts [E] and the guesses of max_running rows [T, D, k]; one row more
    raises (on every device: RoutingSync.start), never remakes it."""
    rn, st = in_process_runner(model, 2, 3, decode_consolidate_every=0, max_running=3, decode_fold=True)
    try:
        moe = rn.moe
        E, k, D = ENGINE_SPEC["n_expert"], ENGINE_SPEC["n_expert_used"], moe.depth
        assert D > 0 and moe.graph_sync.cap == E + 3 * D * k
        counts = torch.zeros(E, dtype=torch.int64)
        moe.graph_sync.start(counts, torch.zeros((3, D, k), dtype=torch.int64))
        with pytest.raises(AssertionError):
            moe.graph_sync.start(counts, torch.zeros((4, D, k), dtype=torch.int64))
    finally:
        close_runner(rn, st)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA"))])
def test_sync_reads_each_start_whatever_shapes_came_before(device):
    """RoutingSync's views and sizes made once a shape pair (_sizes, cpu-host59): starts alternating between shapes
    (no guesses, [1, D, k], [3, D, k], an E of 8 and of 16; on CUDA a larger start regrows the uncapped buffer) each
    finish() with the counts and guessed ids the tensors hold (their own tolist(): the reference)."""
    from betelgeuse.worker.moe_step import RoutingSync
    sync = RoutingSync(torch.device(device))
    gen = torch.Generator().manual_seed(59)
    shapes = [(8, None), (16, (1, 2, 3)), (8, (3, 2, 3)), (16, None), (16, (1, 2, 3)), (8, (3, 2, 3)),
              (16, (40, 2, 3)), (8, (1, 2, 3))]
    for E, gs in shapes * 2:
        counts = torch.randint(0, 9, (E,), generator=gen).to(device)
        guess = None if gs is None else torch.randint(0, E, gs, generator=gen).to(device)
        sync.start(counts, guess)
        c, marks = sync.finish()
        assert c.tolist() == counts.tolist()
        assert (marks is None) == (guess is None)
        if guess is not None:
            assert marks.ids == guess.tolist() and marks.E == E


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_captured_start_is_written_by_each_replay():
    """RoutingSync(cap): start() captured in a graph (the counts computed in it, the event an external node), each
    replay's counts read by expect + finish; a start larger than the buffer raises, never remakes it."""
    from betelgeuse.worker.graphs import capture
    from betelgeuse.worker.moe_step import RoutingSync
    E, G = 16, 6
    sync = RoutingSync(torch.device("cuda"), cap=E + G)
    src = torch.zeros(E, dtype=torch.int64, device="cuda")
    guess_src = torch.zeros((1, 2, 3), dtype=torch.int64, device="cuda")
    counts = torch.empty(E, dtype=torch.int64, device="cuda")
    guess = torch.empty((1, 2, 3), dtype=torch.int64, device="cuda")

    def work():
        counts.copy_(src * 2)
        guess.copy_(guess_src + 1)
        sync.start(counts, guess)
        torch.cuda._sleep(1 << 20)                 # work queued after the event (the at-hand group's place)
    buf = sync.buf.data_ptr()                       # made at init: no pinned allocation inside a capture
    sync.start(counts, guess)                       # the eager first step
    sync.finish()
    g, _ = capture(None, work)
    sync.finish()
    for i in range(3):
        src.copy_(torch.arange(E, device="cuda") + i)
        guess_src.fill_(i)
        g.replay()
        sync.expect(counts, guess)
        c, marks = sync.finish()
        assert c.tolist() == [2 * (e + i) for e in range(E)]
        assert marks.ids == [[[i + 1] * 3] * 2]
    with pytest.raises(AssertionError):
        sync.start(torch.zeros(E + G + 1, dtype=torch.int64, device="cuda"), None)
    assert sync.buf.data_ptr() == buf
