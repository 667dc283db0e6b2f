"""Where a decode's disk idles (services/bench/disk_idle.py over the store reader's gap log, store/reader.py).

- split_idle on gaps and steps laid out by hand: each gap that touches a token boundary (a step's end to the next
  one's start, the run's start or end) is "between", the others "within"; the part outside every step is counted;
- on a real store (its reader threads, its gap log): idle + active = the run's span, active agrees with the reader's
  own active-seconds counter, and a forced gap lands where it should: a pause after each step's forward (a slow
  sampling) adds to "between" and not "within"; a pause inside a step, before a layer's disk reads, adds to
  "within" (decode guesses off, so a layer's reads start only at its own routing);
- the chain of a gap a layer's message ended (land / gpu / host / message / store): laid out by hand, each part cut
  at its step's time; on a real store, a pause forced into one step of the chain (before layer 1's routing reaches
  the host, between its routing and its load's send, between the send and the store taking it) grows that part and
  no other by the pause;
- gpu's split at the worker's device marks (copy / group / attn / route / sync, PassStats.gpu_marks): laid out by
  hand (the parts sum to gpu, marks out of order clipped); on a ds4-tiny CPU decode (per-layer path, solo, lanes)
  every mark is taken, within its step, and ordered against the worker's host stamps and the model's own calls.
"""

from __future__ import annotations

import gc
import time

import pytest

from betelgeuse.worker.store_session import LoadStream
from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_ds4_tiny, write_synth
from services.bench.disk_idle import CHAIN, GPU, chain_label, ended_label, gpu_label, idle_label, split_idle

PAUSE = 0.05        # s, the forced gap per token
STEPS = 5


def test_split_by_hand():
    windows = [(0.0, 10.0), (11.0, 20.0), (20.5, 30.0)]
    gaps = [(-5.0, 1.0), (3.0, 4.0), (9.0, 12.0), (15.0, 15.5), (19.0, 21.0), (29.0, 31.0)]
    s = split_idle(gaps, windows)
    # (-5, 1) clipped to (0, 1) touches the start; (9, 12) the 10-11 boundary (1 s of it outside the steps);
    # (19, 21) the 20-20.5 boundary (0.5 s outside); (29, 31) clipped to (29, 30) touches the end
    assert s["between_s"] == pytest.approx(1 + 3 + 2 + 1) and s["between_gaps"] == 4
    assert s["within_s"] == pytest.approx(1 + 0.5) and s["within_gaps"] == 2
    assert s["outside_s"] == pytest.approx(1.5)
    assert s["span_s"] == 30 and s["active_s"] == pytest.approx(30 - 8.5)
    assert s["between_ms_per_token"] == pytest.approx(7e3 / 3)
    assert "between" in idle_label({"disk_idle": s}) and idle_label({}) == ""
    assert split_idle(gaps, []) == {} and "ended_by" not in s
    # the message that ended each gap: the last one sent by its end, if sent during it
    sends = [(0.5, -1), (3.5, 1), (8.0, 2), (11.5, 0), (15.2, 1), (20.2, -1), (29.5, 1)]
    by = split_idle(gaps, windows, sends)["ended_by"]
    # (0, 1) and (19, 21) by the hash aheads at 0.5 and 20.2; (9, 12) by layer 0's at 11.5; (3, 4), (15, 15.5) and
    # (29, 30) by layer 1's at 3.5, 15.2 and 29.5 (the send at 8.0 is before (9, 12) began: not its end)
    assert by == {"-1": [pytest.approx(3e3 / 3), 0.0], "0": [pytest.approx(3e3 / 3), 0.0],
                  "1": [pytest.approx(1e3 / 3), pytest.approx(1.5e3 / 3)]}, by
    assert split_idle([(3.0, 4.0)], windows, [(2.0, 1)])["ended_by"] == {"other": [0.0, pytest.approx(1e3 / 3)]}
    assert ended_label({"ended_by": by}) == "hash ahead 1000.0 / 0.0, L0 1000.0 / 0.0, L1 333.3 / 500.0"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("idle") / "engine.gguf", **ENGINE_SPEC)


def test_chain_by_hand():
    windows = [(0.0, 10.0)]
    gaps = [(3.0, 4.0), (6.0, 7.0)]
    sends = [(3.6, 1), (6.2, 3), (6.5, -1)]
    # layer 1 routed at 3.4 (layer 2's at 3.45 is another layer's: skipped); the last expert handed over before it at
    # 3.1 (3.5 is after the routing), the store's delivery of it at 3.05 (the load taken at 2.9; 2.95's prefetch
    # delivered none); the store took the message at 3.7, its first read at 4.0
    routed, landed = [(3.4, 1), (3.45, 2)], [(3.1, 0), (3.5, 2), (6.4, 3)]
    msgs = [(2.9, 3.0, 3.05), (2.95, 3.0, None), (3.7, 4.0, None), (6.25, None, 6.3)]
    s = split_idle(gaps, windows, sends, routed, landed, msgs)
    w = s["chain"]["within"]
    # (6, 7) by the hash ahead at 6.5, layer 3's load sent during it at 6.2 (it read nothing) and taken at 6.25: earlier
    # 0.25; its last expert at the store's delivery 6.3 (land 0.05), the worker's 6.4 (deliver 0.1); the hash ahead has
    # no routing (host 0, gpu 0.1) and the store took nothing after it (message 0, store 0.5)
    want = {"earlier": 0.25, "land": 0.05 + 0.05, "deliver": 0.05 + 0.1, "gpu": 0.3 + 0.1, "host": 0.2,
            "message": 0.1, "store": 0.3 + 0.5}
    assert {k: w[k] for k in CHAIN} == pytest.approx({k: v * 1e3 for k, v in want.items()}), w
    assert w["gaps"] == 2 and w["own_read"] == 1 and s["chain"]["between"]["gaps"] == 0
    assert "earlier 250.00 / land 100.00 / deliver 150.00" in chain_label(s) and chain_label(s, "between") == ""
    assert "chain" not in split_idle(gaps, windows, sends)
    assert GPU[0] not in w and gpu_label(s) == ""        # no device marks: gpu not cut (an older record)


def test_gpu_split_by_hand():
    """gpu (the landed expert -> the next layer's routing on the host) cut at the device's marks: each the last of
    its (name, layer) by the routing, clipped into gpu after the part before; the parts sum to gpu."""
    windows = [(0.0, 10.0)]
    gaps = [(3.0, 4.0), (6.0, 7.0)]
    sends = [(3.6, 1), (6.5, -1)]
    routed, landed = [(3.4, 1)], [(3.1, 0), (6.4, 3)]
    msgs = [(2.9, 3.0, 3.05), (3.7, 4.0, None)]
    # (3, 4): layer 0 landed at 3.1, layer 1 routed at 3.4; layer 0's copy ends 3.15 (an older step's at 1.0 and a
    # later one at 3.5, after the routing, are not it), its group 3.2, layer 1's attention 3.3, its routing 3.35.
    # (6, 7), the hash ahead at 6.5 (no routing: gpu runs to the send): layer 3's copy 6.42, group 6.45; layer -1 has
    # no attention or routing mark (0) and layer 1's (of the first gap) are before the landing: clipped to 0
    marks = [(1.0, 0, "copy"), (3.12, 0, "copy0"), (3.15, 0, "copy"), (3.2, 0, "group"), (3.3, 1, "attn"),
             (3.35, 1, "route"), (3.5, 0, "copy"), (6.41, 3, "copy0"), (6.42, 3, "copy"), (6.45, 3, "group")]
    s = split_idle(gaps, windows, sends, routed, landed, msgs, marks)
    w = s["chain"]["within"]
    want = {"copy": 0.05 + 0.02, "group": 0.05 + 0.03, "attn": 0.1, "route": 0.05, "sync": 0.05 + 0.05}
    assert {k: w[k] for k in GPU} == pytest.approx({k: v * 1e3 for k, v in want.items()}), w
    assert sum(w[k] for k in GPU) == pytest.approx(w["gpu"]) and w["gpu"] == pytest.approx(400.0)
    # the rest of the chain as without marks
    plain = split_idle(gaps, windows, sends, routed, landed, msgs)["chain"]["within"]
    assert {k: w[k] for k in CHAIN} == pytest.approx({k: plain[k] for k in CHAIN})
    assert gpu_label(s) == "copy 70.00 / group 80.00 / attn 100.00 / route 50.00 / sync 100.00 (of gpu 400.00)"
    # marks out of order (attention after the routing mark): clipped, route 0, still summing to gpu
    late = [(t + (0.06 if n == "attn" else 0.0), la, n) for t, la, n in marks]
    w2 = split_idle(gaps, windows, sends, routed, landed, msgs, late)["chain"]["within"]
    assert w2["attn"] == pytest.approx(160.0) and w2["route"] == pytest.approx(0.0)
    assert sum(w2[k] for k in GPU) == pytest.approx(w2["gpu"])


def _pause_at_layer_1(obj, name: str, seconds: float) -> None:
    """obj.name(layer, ...) sleeps `seconds` before it runs for layer 1 (the others as they were)."""
    fn = getattr(obj, name)

    def slow(l, *a, **kw):
        if l == 1:
            time.sleep(seconds)
        return fn(l, *a, **kw)
    setattr(obj, name, slow)


def _decode(path, pause_between: float = 0.0, pause_within: float = 0.0, pause_host: float = 0.0,
            pause_message: float = 0.0, pause_deliver: float = 0.0) -> tuple[dict, float]:
    """STEPS greedy decode steps timed as the bench times them (its forward and sampling on the monotonic clock), the
    store's idle gaps split -> (the split, the reader's active seconds over the run). Decode guesses off: each layer
    reads its disk experts at its own routing. pause_within: a sleep at layer 1's host step, before its routing's
    sync; pause_host: after it, before the load's send; pause_message: in the load's message, before the store takes
    it; pause_deliver: after the store delivered layer 1's last disk expert, before the worker has it."""
    # 1 VRAM slot, no host slot and 4 staging slots: a layer's experts are read from disk in nearly every token (few
    # stay staged from the token before), so layer 1's reads follow the pause within the step
    rn, st = in_process_runner(path, 1, 0, prefetch_decode=False, staging_slots=4)
    try:
        kv = rn.new_cache(96)
        tok = int(rn.forward(prompt(16, ENGINE_SPEC["n_vocab"], seed=3), kv)[0][-1].argmax())
        rn.settle()
        if pause_within:
            _pause_at_layer_1(rn.moe, "_partial", pause_within)
        if pause_host:
            _pause_at_layer_1(rn.moe, "_send_loads", pause_host)
        if pause_message:
            load = st.load

            def slow_load(session, keys, *a, **kw):
                if keys and keys[0][0] == 1:
                    time.sleep(pause_message)
                return load(session, keys, *a, **kw)
            st.load = slow_load
        if pause_deliver:
            groups = rn.moe._disk_groups

            def slow_groups(l, r, loads, n_disk, *a, **kw):
                if l == 1:
                    def late(it):     # the store's generator, the last expert's delivery stamped, then the pause
                        for i, got in enumerate(it):
                            if i == n_disk - 1:
                                time.sleep(pause_deliver)
                            yield got
                    loads = LoadStream(late(loads))     # MoEStep reads a LoadStream's `it` (cpu-host61)
                return groups(l, r, loads, n_disk, *a, **kw)
            rn.moe._disk_groups = slow_groups
        windows, sends, routed, landed = [], [], [], []
        a0 = st.status()["disk_active_seconds"]
        gc.collect()            # no collection inside the timed steps: a full one took 0.14 s under pytest (an idle
        gc.disable()            # stretch of its own, in whichever step it fell)
        for _ in range(STEPS):
            w0 = time.monotonic()
            lg, stats = rn.forward([tok], kv, consolidate=False)
            sends += stats.sends
            routed += stats.routed
            landed += stats.landed
            tok = int(lg[-1].argmax())
            if pause_between:
                time.sleep(pause_between)       # a slow sampling: after the step's last read, inside its window
            windows.append((w0, time.monotonic()))
        gc.enable()
        end = st.status(disk_gaps_since=windows[0][0])
        assert end["disk_gaps_complete"] and end["disk_clock"] >= windows[-1][1]
        return (split_idle(end["disk_gaps"], windows, sends, routed, landed, end["disk_msgs"]),
                end["disk_active_seconds"] - a0)
    finally:
        gc.enable()
        close_runner(rn, st)


def test_forced_gaps_land_where_they_should(model):
    base, active = _decode(model)
    for s, act in ((base, active),):
        assert s["between_s"] >= 0 and s["within_s"] >= 0 and s["tokens"] == STEPS
        assert s["idle_s"] + s["active_s"] == pytest.approx(s["span_s"])
        # the gap log against the reader's own active counter (which also spans the status calls around the run)
        assert s["active_s"] <= act + 0.002 and s["active_s"] >= act - 0.02, (s, act)
        assert s["within_gaps"] > 0            # guesses off: the disk idles between a token's layers
    between, _ = _decode(model, pause_between=PAUSE)
    assert between["between_s"] - base["between_s"] >= 0.8 * STEPS * PAUSE, (between, base)
    assert between["within_s"] - base["within_s"] <= 0.3 * STEPS * PAUSE, (between, base)
    within, _ = _decode(model, pause_within=PAUSE)
    assert within["within_s"] - base["within_s"] >= 0.6 * STEPS * PAUSE, (within, base)
    # and the disk waited for layer 1's loads (guesses off: its own message ends the pause's gap)
    grew = within["ended_by"]["1"][1] - base["ended_by"].get("1", [0.0, 0.0])[1]
    assert grew >= 0.6 * PAUSE * 1e3, (within["ended_by"], base["ended_by"])


def test_chain_parts_take_the_pause(model):
    """A pause forced at one step of layer 1's chain grows that part of the within gaps (by >= 0.6 of it a token) and
    no other by more than 0.3 of it: the parts are cut where the chain's steps happen."""
    base, _ = _decode(model)
    assert base["chain"]["within"]["gaps"] > 0
    for kw, part in (("pause_within", "gpu"), ("pause_host", "host"), ("pause_message", "message"),
                     ("pause_deliver", "deliver")):
        got, _ = _decode(model, **{kw: PAUSE})
        grew = {k: got["chain"]["within"][k] - base["chain"]["within"][k] for k in CHAIN}
        assert grew[part] >= 0.6 * PAUSE * 1e3, (kw, grew)
        assert all(v <= 0.3 * PAUSE * 1e3 for k, v in grew.items() if k != part), (kw, grew)


@pytest.mark.parametrize("form", ["default", "solo", "lanes"])
def test_gpu_marks_on_a_cpu_decode(tmp_path, form):
    """ds4-tiny decode steps on the CPU with the device marks on (PassStats.gpu_marks, host stamps here): every kind is
    taken, each within its step, and in the chain's order against the worker's own host stamps: a layer's last disk
    batch copied after its last expert was handed over (landed), its group after that copy and its group's return; a
    routed layer's attention mark between its attention's return and its MoE input, before its routing mark, that
    before the routing's host stamp (routed). Off: none taken. form: the CPU's per-layer path, or the static form
    CUDA decodes (SoloDecode, the lanes), eagerly (deploy/device/decode_host.py --form)."""
    path = write_ds4_tiny(tmp_path / "ds4.gguf", expert_qtype="Q8_0", seed=2)
    rn, st = in_process_runner(path, 1, 0, prefetch_decode=False, staging_slots=4)
    try:
        n_vocab = int(rn.mcfg.n_vocab)
        kv = rn.new_cache(64)
        tok = int(rn.forward(prompt(8, n_vocab, seed=3), kv)[0][-1].argmax())
        rn.settle()
        lg, off = rn.forward([tok], kv, consolidate=False)
        assert off.gpu_marks == [] and not rn.gpu_marks
        tok = int(lg[-1].argmax())
        # independent stamps: each layer's attention's return, its MoE input's call, each expert group's return
        seen = {"attn": [], "input": [], "apply": []}
        m, moe = rn.model, rn.moe

        def stamped(fn, key, after: bool):
            def wrap(layer, *a, **kw):
                if not after:
                    seen[key].append((time.monotonic(), layer))
                out = fn(layer, *a, **kw)
                if after:
                    seen[key].append((time.monotonic(), layer))
                return out
            return wrap
        attn = "attend_static" if form == "lanes" else "attention_block"    # the lanes: attention's core alone
        setattr(m, attn, stamped(getattr(m, attn), "attn", True))
        m.moe_input = stamped(m.moe_input, "input", False)
        apply = moe._apply
        moe._apply = lambda r, layer, *a, **kw: stamped(lambda _l: apply(r, layer, *a, **kw), "apply", True)(layer)
        rn.gpu_marks = True
        steps = []
        rn._static_decode = form != "default"
        for _ in range(3):
            w0 = time.monotonic()
            if form == "lanes":
                lg, stats = rn.decode_batch([tok], [kv])
            else:
                lg, stats = rn.forward([tok], kv, consolidate=False)
            steps.append((w0, time.monotonic(), stats))
            tok = int(lg[-1].argmax())
        rn.gpu_marks = False
    finally:
        close_runner(rn, st)
    kinds = set()
    for w0, w1, stats in steps:
        marks = stats.gpu_marks
        assert marks and all(w0 <= t <= w1 for t, _, _ in marks), (w0, w1, marks)
        kinds |= {n for _, _, n in marks}
        at = {}
        for t, layer, name in marks:
            at.setdefault((name, layer), []).append(t)
        assert stats.landed and stats.routed
        for t, layer in stats.landed:       # the layer's last batch: copied after its last expert, then its group
            c0, c1, g = at[("copy0", layer)][-1], at[("copy", layer)][-1], at[("group", layer)][-1]
            assert t <= c0 <= c1 <= g, (layer, t, c0, c1, g)
        for t, layer in stats.routed:       # attention, routing enqueued, then the host has it
            a, r = at[("attn", layer)][-1], at[("route", layer)][-1]
            assert a <= r <= t, (layer, a, r, t)
        for t, layer in stats.landed:       # the group mark after the layer's last group (its return)
            g = at[("group", layer)][-1]
            assert max(ta for ta, la in seen["apply"] if la == layer and w0 <= ta <= w1) <= g, layer
        for t, layer in stats.routed:       # the attention mark between the attention's return and the MoE input
            a = at[("attn", layer)][-1]
            end = max(ta for ta, la in seen["attn"] if la == layer and w0 <= ta <= a)
            nxt = min(ta for ta, la in seen["input"] if la == layer and ta >= a)
            assert end <= a <= nxt <= w1, (layer, end, a, nxt)
    assert kinds == {"copy0", "copy", "group", "attn", "route"}, kinds
