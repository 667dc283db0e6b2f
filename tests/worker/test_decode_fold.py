"""The solo decode graphs' folded start (MoEStep.hand_fold, issue 21: host time per expert application): each layer's
routing sync copies and event, captured in the layer's graph before its at-hand group, so a replayed step makes one
graph launch and one host part a layer, not two of each.

On the CPU (eager, as the tests force the static form) the fold must be the unfolded path's bits, reads and guesses,
step by step (the unfolded path is itself checked against the partial path, and that one against transformers:
test_decode_at_hand.py, test_decode_static.py), and the step must yield one host part per layer with a miss path;
gpu_marks keeps the unfolded form. On CUDA (skipped here): a start captured in a graph is written by its replay
(the external event waited for), and the graph sync's buffer is never remade.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth
from betelgeuse.worker import decode_graphs

V = ENGINE_SPEC["n_vocab"]
GUESS = ("guessed", "guess_hits", "guess_disk")      # (the bytes read ahead depend on the store's timing)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("fold") / "engine.gguf", **ENGINE_SPEC)


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
