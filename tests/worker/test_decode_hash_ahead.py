"""The hash-routed layers' disk reads at a decode step's start (issue 21, engine.prefetch_hash; MoEStep.hash_ahead).

deepseek4's first n_hash layers choose their experts by token id (tid2eid[token]), so a decode step knows them before
layer 0 runs. With prefetch_hash on:
  - the logits are the same bits as off, in the sliced and static solo decode and the batched one (rows, lanes)
    (invariant 1: a read only moves earlier);
  - the reads asked are exactly those layers' experts of the step's tokens that sit on disk, by the file's own table
    (read with the gguf package, not ours), and every one is then used (hash_ahead_hits = hash_ahead); off, the
    counters stay 0;
  - the store starts layer 0's disk reads before layer 0's routing sync (an event log: the store's read starts and
    the layers' host steps, in order); off, it never does (the check can fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from betelgeuse.store.directory import TIER_DISK
from engine_helpers import close_runner, greedy_steps, in_process_runner, write_ds4_tiny

STEPS = 4
PROMPTS = [[int(x) for x in np.random.default_rng(s).integers(0, 512, 24)] for s in (4, 7)]
FIELDS = ("hash_ahead", "hash_ahead_started", "hash_ahead_bytes", "hash_ahead_hits")


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    # 32 experts (2 used), 2 VRAM + 3 host slots a layer: most of a token's hash-layer experts sit on disk, and 8
    # staging slots keep few of them staged from the tokens before
    return write_ds4_tiny(tmp_path_factory.mktemp("hash-ahead") / "ds4.gguf", expert_qtype="Q8_0", seed=3, n_expert=32)


def _file_table(path) -> list[np.ndarray]:
    """The hash layers' tid2eid [V, k] from the file, through the gguf package's reader (not betelgeuse's)."""
    import gguf
    r = gguf.GGUFReader(str(path))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    n = int(r.fields[f"{arch}.hash_layer_count"].parts[-1][0])
    by_name = {t.name: t for t in r.tensors}
    return [np.asarray(by_name[f"blk.{l}.ffn_gate_tid2eid.weight"].data) for l in range(n)]      # [V, k] each


def _decode(path, form: str, on: bool, log: list | None = None, asked: list | None = None):
    """The prompts prefilled, then STEPS greedy decode steps (form "sliced" / "static": forward() of one token per
    prompt; "rows" / "batch": decode_batch of all, each row's dense part alone / the static lanes) with prefetch_hash
    on or off -> (logits [STEPS, n, V], the decode stats).
    log: gets ("step",), ("read", (layer, expert), priority) for every disk read the store starts and ("sync", l) at
    every layer's host step (its routing sync). asked: per decode pass, (its tokens, the first prefetch's keys, the
    snapshot's disk tiers [n_layer, E])."""
    rn, st = in_process_runner(path, 2, 3, prefetch_hash=on, prefetch_depth=1, max_running=len(PROMPTS),
                               staging_slots=8)
    rn._static_decode = form in ("static", "batch")
    try:
        kvs = [rn.new_cache(96) for _ in PROMPTS]
        toks = [int(rn.forward(p, kv)[0][-1].argmax()) for p, kv in zip(PROMPTS, kvs)]
        rn.settle()
        if log is not None:
            start_read, partial = st._start_read, rn.moe._partial

            def read_logged(key, slot, priority, *rest):
                log.append(("read", tuple(key), priority))
                return start_read(key, slot, priority, *rest)

            def partial_logged(l, *a, **kw):
                log.append(("sync", l))
                return partial(l, *a, **kw)
            st._start_read, rn.moe._partial = read_logged, partial_logged
        if asked is not None:
            hash_ahead, prefetch = rn.moe.hash_ahead, rn.session.prefetch_start

            def hash_logged(tokens, snap, stats):
                asked.append([list(tokens), None, snap["tier"] == TIER_DISK])
                rn.session.prefetch_start = lambda keys, drop=(): (asked[-1].__setitem__(1, list(keys)),
                                                                   prefetch(keys, drop))[1]
                try:
                    return hash_ahead(tokens, snap, stats)
                finally:
                    rn.session.prefetch_start = prefetch
            rn.moe.hash_ahead = hash_logged
        return greedy_steps(rn, toks, kvs, form, STEPS, None if log is None else lambda: log.append(("step",)))
    finally:
        close_runner(rn, st)


def _sum(stats, name: str) -> int:
    return sum(getattr(s, name) for s in stats)


@pytest.mark.parametrize("form", ["sliced", "static", "rows", "batch"])
def test_hash_ahead_keeps_bits_and_reads_the_tables_experts(ds4, form):
    off, s_off = _decode(ds4, form, False)
    asked: list = []
    on, s_on = _decode(ds4, form, True, asked=asked)
    assert torch.equal(on, off), form
    assert all(_sum(s_off, k) == 0 for k in FIELDS), {k: _sum(s_off, k) for k in FIELDS}
    n = _sum(s_on, "hash_ahead")
    assert n > 0 and _sum(s_on, "hash_ahead_hits") == n, (n, _sum(s_on, "hash_ahead_hits"))  # exact: all used
    started = _sum(s_on, "hash_ahead_started")
    assert 0 < started <= n and _sum(s_on, "hash_ahead_bytes") > 0
    table = _file_table(ds4)
    steps_with_keys = 0
    for tokens, keys, disk in asked:      # every pass: the table's experts of its tokens on disk, layer by layer
        want = [(l, e) for l, t in enumerate(table) for e in sorted({int(x) for tok in tokens for x in t[tok]})
                if disk[l, e]]
        assert (keys or []) == want, (tokens, keys, want)
        steps_with_keys += bool(want)
    assert len(asked) == STEPS * (1 if form in ("rows", "batch") else len(PROMPTS)) and steps_with_keys > 0


def _early_layer0_reads(log: list) -> tuple[int, int]:
    """Per step, whether a layer-0 disk read started before layer 0's host step (its routing sync) -> (steps where
    one did, steps with a layer-0 disk read at all)."""
    early = total = 0
    step: list = []
    for ev in log + [("step",)]:
        if ev[0] != "step":
            step.append(ev)
            continue
        if step:
            sync0 = next((i for i, e in enumerate(step) if e == ("sync", 0)), len(step))
            reads0 = [i for i, e in enumerate(step) if e[0] == "read" and e[1][0] == 0]
            total += bool(reads0)
            early += bool(reads0) and reads0[0] < sync0
        step = []
    return early, total


def test_hash_reads_start_before_layer_0s_routing_sync(ds4):
    log_on: list = []
    _decode(ds4, "sliced", True, log=log_on)
    early, total = _early_layer0_reads(log_on)
    assert total > 0 and early == total, (early, total)
    log_off: list = []
    _decode(ds4, "sliced", False, log=log_off)
    early, total = _early_layer0_reads(log_off)
    assert total > 0 and early == 0, (early, total)      # off: layer 0 reads only once its routing is known
