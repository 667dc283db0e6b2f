"""The flex expert cache (worker/flex_cache.py): copies of experts read from disk, kept in the VRAM the plan reserves
for sequences not running, computed from in place of a disk read.

What must hold, with a real store (its reader threads, its staging slots) and the tiny engine model on the CPU:
- a decode whose misses repeat (the same prompt decoded twice, the store's staging slots too few to keep anything)
  reads fewer disk bytes with the cache on than off, and its logits are the same bits;
- the cache lives only in the reservation running sequences do not use: before a sequence's KV is allocated the cache
  gives the room back, so its bytes + the KV caches held never exceed the plan's KV reservation for max_running
  sequences (a byte counter checked at every KV allocation and every fill), and it did hold more than that leaves
  before the admissions (else the check proves nothing).
"""

from __future__ import annotations

import threading

import pytest
import torch

from betelgeuse.api import GenerateRequest, SamplingParams
from betelgeuse.config import EngineConfig

from engine_helpers import (ENGINE_SPEC, StateBytes, close_runner, engine_and_store, in_process_runner, prompt,
                            write_synth)

V = ENGINE_SPEC["n_vocab"]
# 2 VRAM + 3 host slots of 32 experts per layer, 6 staging slots: nearly every routed expert is a disk read, and the
# store keeps almost none staged. max_context 1024: one sequence's KV (768 KiB) holds 21 flex slots of 36 KiB
TIERS = dict(vram_slots=2, host_slots=3)
CFG = dict(max_context=1024, staging_slots=6, decode_consolidate_every=0, prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("flex") / "engine.gguf", **ENGINE_SPEC)


def _decode_twice(model, flex: bool, steps: int = 8):
    """One prompt prefilled and decoded `steps` tokens, twice over (the second: decode_batch in the static lanes'
    form), one sequence holding KV -> (decode logits [2 * steps] of [V], disk bytes of the decode passes, flex hits)."""
    rn, st = in_process_runner(model, TIERS["vram_slots"], TIERS["host_slots"], max_running=2, flex_cache=flex, **CFG)
    try:
        assert (rn.flex is not None) == flex
        out, disk, hits = [], 0, 0
        for rep in range(2):
            kv = rn.new_cache(64)
            lg, _ = rn.forward(prompt(24, V, seed=5), kv, consolidate=False)
            tok = int(lg[-1].argmax())
            rn._static_decode = rep == 1
            for _ in range(steps):
                lg, s = rn.decode_batch([tok], [kv]) if rep else rn.forward([tok], kv, consolidate=False)
                lg = lg.reshape(-1, V)[-1]
                disk += s.disk_bytes
                hits += s.flex_hits
                out.append(lg)
                tok = int(lg.argmax())
            rn.release(kv)               # the one sequence ends: its KV room is the cache's again
        return out, disk, hits
    finally:
        close_runner(rn, st)


def _held_as_ref(f, ref, L: int, E: int, sb: int) -> dict:
    """f's (layer, expert) -> slot map, its LRU and every held slot's bytes equal the per-expert reference's."""
    held = {(l, e): int(f.where[l, e]) for l in range(L) for e in range(E) if f.where[l, e] >= 0}
    assert held == ref.where
    assert list(f.lru) == ref.lru
    for (l, e), s in held.items():
        c, i = divmod(s, f.per_chunk)
        assert torch.equal(f.chunks[c][i * sb:(i + 1) * sb], ref.bytes[s]), (l, e, s)
    return held


def test_flex_cache_auto_is_off_on_the_cpu(model):
    rn, st = in_process_runner(model, TIERS["vram_slots"], TIERS["host_slots"], max_running=2, **CFG)
    try:
        assert rn.cfg.flex_cache == "auto" and rn.flex is None
    finally:
        close_runner(rn, st)


def test_repeated_misses_read_less_from_disk_with_the_same_bits(model):
    off, disk_off, hits_off = _decode_twice(model, False)
    on, disk_on, hits_on = _decode_twice(model, True)
    for i, (a, b) in enumerate(zip(off, on)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max().item():.3e}, not bit-identical"
    assert hits_off == 0 and hits_on > 0
    assert disk_on < 0.8 * disk_off, (disk_on, disk_off, hits_on)


def _req(ids, n):
    return GenerateRequest(prompt_ids=ids, max_tokens=n, ignore_eos=True, sampling=SamplingParams(temperature=0.0))


def test_admission_shrinks_the_cache_before_allocating_kv(model):
    """max_running 3: a lone request leaves two sequences' KV room to the cache, which fills it; then three requests
    together: each admission gives back its state's bytes before the KV is allocated. The byte counter (flex bytes +
    the KV caches held) stays within the plan's KV reservation at every KV allocation and every fill."""
    cfg = EngineConfig(model_path=str(model), read_threads=2, max_running=3, admission_window=0.2, flex_cache=True,
                       **TIERS, **CFG)
    with engine_and_store(cfg) as eng:
        rn = eng.runner
        flex = rn.flex
        count = StateBytes(rn)              # budget: the plan's KV bytes for max_running sequences (no graphs here)
        assert flex is not None and flex.units == 3 and flex.unit_bytes * 3 == count.budget

        list(eng.submit(_req(prompt(24, V, seed=5), 8)))
        lone = flex.nbytes
        assert lone > flex.unit_bytes, flex.describe()       # it grew into two sequences' unused room
        got = [None] * 3

        def client(i):
            got[i] = list(eng.submit(_req(prompt(20 + i, V, seed=30 + i), 6)))
        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not count.over, f"flex + KV bytes over the plan's KV reservation: {count.over[:3]}"
        assert all(g is not None and g[-1].finish_reason == "length" for g in got), got
        assert count.all_released(), (count.live, flex.describe())
        assert count.checks > 10 and count.peak <= count.budget


def test_split_is_the_numpy_rule_over_random_fills():
    """FlexCache.split on the experts' lists (a layer with no copy returns at once: FlexCache.copies) against the
    rule in numpy (held = where >= 0; a copy of an expert now in the VRAM tier dropped, the other held ones hit, moved
    to the LRU's end), over random fills that evict and splits that drop: the returned arrays, the LRU order, where
    and the stats after every call, and copies = the experts with a copy per layer."""
    import numpy as np

    from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM
    from betelgeuse.worker.flex_cache import FlexCache
    L, E, sb = 4, 16, 64
    f = FlexCache(sb, sb * 3, 2, L, E, torch.device("cpu"))            # 6 slots: fills evict
    pool = torch.arange(sb * 8, dtype=torch.int64).to(torch.uint8)
    rng = np.random.default_rng(5)
    seen = set()
    for _ in range(300):
        layer = int(rng.integers(0, L))
        if rng.random() < 0.5:
            es = rng.choice(E, size=int(rng.integers(1, 4)), replace=False).tolist()
            f.keep(layer, es, pool, [sb * int(i) for i in rng.integers(0, 8, len(es))])
        used = np.sort(rng.choice(E, size=int(rng.integers(1, 9)), replace=False)).astype(np.int64)
        tiers = rng.choice([TIER_VRAM, TIER_HOST, TIER_DISK], size=len(used), p=[0.2, 0.4, 0.4]).astype(np.int8)
        slots = f.where[layer, used].copy()              # the reference, before split changes anything
        held = slots >= 0
        vram, hit = held & (tiers == TIER_VRAM), held & (tiers != TIER_VRAM)
        lru = [s for s in f.lru if s not in set(slots[vram].tolist())]
        lru = [s for s in lru if s not in set(slots[hit].tolist())] + slots[hit].tolist()
        hits, dropped = f.stats.hits + int(hit.sum()), f.stats.dropped + int(vram.sum())
        if rng.random() < 0.5:          # split_lists (the decode short paths'): the same rule on Python lists
            u, t, h = (np.asarray(x, dtype=y.dtype) for x, y in
                       zip(f.split_lists(layer, used.tolist(), tiers.tolist()), (used, tiers, used)))
            seen.add("lists")
        else:
            u, t, h = f.split(layer, used, tiers)
        assert u.tolist() == used[~hit].tolist() and t.tolist() == tiers[~hit].tolist()
        assert h.tolist() == used[hit].tolist() and u.dtype == used.dtype and t.dtype == tiers.dtype
        assert list(f.lru) == lru and (f.stats.hits, f.stats.dropped) == (hits, dropped)
        assert (f.where[layer, used[vram]] == -1).all()
        assert f.copies == [set(np.flatnonzero(w >= 0).tolist()) for w in f.where]
        seen.add((bool(vram.any()), bool(hit.any()), bool(held.any())))
    assert len(seen) >= 5 and "lists" in seen and f.stats.evictions > 0, seen


class _PerExpertKeep:
    """The reference for FlexCache.keep: a copy_ per expert, in order (the form before the copies were batched), with
    its own bookkeeping: LRU slot order, where, owner and each slot's bytes, from nothing of FlexCache's but its
    fixed slot ids (chunk c's slots c * per_chunk + i; a chunk allocated only when no slot is free, room allowing)."""

    def __init__(self, slot_bytes: int, n_slots: int):
        self.sb, self.n_slots = slot_bytes, n_slots
        self.where: dict[tuple[int, int], int] = {}
        self.owner: dict[int, tuple[int, int]] = {}
        self.lru: list[int] = []
        self.bytes: dict[int, torch.Tensor] = {}
        self.next = 0                                    # slots handed out so far, in id order (one chunk here)

    def keep(self, layer, experts, pool):
        for e, off in experts:
            if (layer, e) in self.where:
                s = self.where[(layer, e)]
                self.lru.remove(s)
                self.lru.append(s)
                continue
            if self.next < self.n_slots:
                s, self.next = self.next, self.next + 1
            else:
                s = self.lru.pop(0)
                del self.where[self.owner.pop(s)]
            self.bytes[s] = pool[off: off + self.sb].clone()
            self.where[(layer, e)], self.owner[s] = s, (layer, e)
            self.lru.append(s)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: the real fused foreach kernel"))])
def test_keep_is_the_per_expert_copies_over_random_fills(monkeypatch, device):
    """FlexCache.keep (one _foreach_copy_ a call) against per-expert copies in order over random fills: batches
    larger than the cache (a slot evicted and rewritten within one call), experts repeated within a call and across
    calls (an LRU move, no copy); after each call the held experts, the LRU order and every held slot's bytes equal
    the reference's. The batched copy runs here in reverse order, as CUDA's fused foreach kernel promises no order
    between its tensors: a batch that names a slot twice (the evicted expert's bytes not dropped) fails. On CUDA the
    real kernel, device-to-device (the ring bank to a flex chunk, as _disk_groups copies)."""
    import numpy as np

    from betelgeuse.worker.flex_cache import FlexCache
    L, E, sb, n_slots = 3, 12, 32, 6
    f = FlexCache(sb, sb * 3, 2, L, E, torch.device(device))           # 2 chunks of 3 slots: 6, fills evict
    ref = _PerExpertKeep(sb, n_slots)
    pool = torch.randint(0, 256, (sb * 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    pool = pool.to(device)
    rng = np.random.default_rng(11)
    rewritten = 0
    real = torch._foreach_copy_

    def unordered(dsts, srcs):
        for d, x in reversed(list(zip(dsts, srcs))):
            real([d], [x])
    if device == "cpu":
        monkeypatch.setattr(torch, "_foreach_copy_", unordered)
    for _ in range(400):
        layer = int(rng.integers(0, L))
        n = int(rng.integers(1, 10))                                      # up to 9 > 6 slots
        es = rng.integers(0, E, n).tolist()                               # repeats allowed
        offs = [sb * int(i) for i in rng.integers(0, 16, n)]
        fills = f.stats.fills
        views = [pool[o: o + sb] for o in offs] if rng.random() < 0.5 else None    # a caller's views, or slices
        f.keep(layer, es, pool, offs, views)
        ref.keep(layer, list(zip(es, offs)), pool)
        rewritten += f.stats.fills - fills > n_slots              # a slot filled twice in this call
        for (l, e), s in _held_as_ref(f, ref, L, E, sb).items():
            assert f.owner[s].tolist() == [l, e]
    assert rewritten > 0 and f.stats.fills > 100, (rewritten, f.stats.fills)


def test_take_is_keeps_bookkeeping_without_a_slot_twice_a_call():
    """FlexCache.take (a decode miss layer's flex slots, taken before the copies: MoEStep._direct_group, whose group
    reads every slot given) against _PerExpertKeep's bookkeeping with one rule more: a slot is never given twice in
    one call (keep would evict this call's own copy for a later expert; take answers None, the expert goes through a
    ring bank). Random calls larger than the cache and with repeats (a held expert: None, the LRU touched); the caller's
    copies go to views[s]. After each call: the held experts, the LRU order, every held slot's bytes, and the slot's
    address and source (addresses, sources: where the group's table and the torch kernels find it)."""
    import numpy as np

    from betelgeuse.worker.flex_cache import FlexCache
    L, E, sb, n_slots = 3, 12, 32, 6
    f = FlexCache(sb, sb * 3, 2, L, E, torch.device("cpu"))           # 2 chunks of 3 slots: 6, fills evict
    ref = _PerExpertKeep(sb, n_slots)
    pool = torch.randint(0, 256, (sb * 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    rng = np.random.default_rng(12)
    refused = 0
    for _ in range(400):
        layer = int(rng.integers(0, L))
        n = int(rng.integers(1, 10))                                      # up to 9 > 6 slots
        es = rng.integers(0, E, n).tolist()                               # repeats allowed
        offs = [sb * int(i) for i in rng.integers(0, 16, n)]
        want, mine = [], set()                                            # the reference's answer
        for e, off in zip(es, offs):
            if (layer, e) in ref.where:
                ref.keep(layer, [(e, off)], pool)                         # an LRU move, no copy
                want.append(None)
            elif ref.next >= ref.n_slots and ref.lru[0] in mine:
                want.append(None)                                         # only this call's slots left to evict
            else:
                ref.keep(layer, [(e, off)], pool)
                mine.add(ref.where[(layer, e)])
                want.append(ref.where[(layer, e)])
        got = f.take(layer, es)
        assert got == want, (got, want)
        refused += sum(s is None and (layer, e) not in ref.where for s, e in zip(got, es))
        for s, off in zip(got, offs):
            if s is not None:
                f.views[s].copy_(pool[off: off + sb])
        for (l, e), s in _held_as_ref(f, ref, L, E, sb).items():
            c, i = divmod(s, f.per_chunk)
            t, o = f.sources[s]
            assert t is f.chunks[c] and o == i * sb
            a, v = f.addresses[s], f.views[s]                             # _direct_group's (address, view)
            assert a == f.chunks[c].data_ptr() + i * sb == v.data_ptr() and v.numel() == sb
    assert refused > 0 and f.stats.evictions > 50, (refused, f.stats)


def test_the_log_names_every_changed_copy():
    """FlexCache.changed (a set, cpu-host60) holds every (layer, expert) whose `where` changed since the log was last
    taken, whichever way (take's fills and evictions, keep's, split_lists' drop of a copy now in VRAM, a shrink's
    drops), and FlexCache.logged counts at least its entries (one an add). Fails with any of _forget's or _assign's
    adds removed."""
    import numpy as np

    from betelgeuse.store.directory import TIER_DISK, TIER_VRAM
    from betelgeuse.worker.flex_cache import FlexCache
    L, E, sb = 3, 12, 32
    f = FlexCache(sb, sb * 4, 3, L, E, torch.device("cpu"))               # chunks of 4 slots, room 12: fills evict
    pool = torch.zeros(sb * E, dtype=torch.uint8)
    rng = np.random.default_rng(60)
    seen, kinds = f.where.copy(), set()
    for i in range(400):
        op = rng.integers(0, 4)
        layer, es = int(rng.integers(0, L)), sorted(set(rng.integers(0, E, int(rng.integers(1, 5))).tolist()))
        if op == 0:
            f.take(layer, es)
        elif op == 1:
            f.keep(layer, es, pool, [e * sb for e in es])
        elif op == 2:                                  # a held copy's expert now in VRAM: split drops it
            tiers = [TIER_VRAM if rng.random() < 0.5 else TIER_DISK for _ in es]
            f.split_lists(layer, es, tiers)
        else:                                          # KV takes the room: chunks (and their copies) go
            f.hold(int(rng.choice([0, sb * 4, sb * 8])))
        moved = {(int(a), int(b)) for a, b in zip(*np.nonzero(f.where != seen))}
        if moved:
            kinds.add(int(op))
        assert moved <= f.changed and f.logged >= len(f.changed), (i, op, moved - f.changed)
        if rng.random() < 0.3:                         # the table reads it (AtHand: _patch or a rebuild)
            f.changed, f.logged, seen = set(), 0, f.where.copy()
    assert kinds == {0, 1, 2, 3}, kinds                 # every way of changing a copy was exercised


def test_take_grows_where_grow_would_under_random_holds():
    """take asks _grow until it refuses once a call (cpu-host60; nothing _grow reads changes in a call but by its own
    growth): against the same fills on a twin cache whose every slot-less fill asks _grow itself, with the room
    moving under them (hold: the sequences' KV bytes, chunks given back and grown again, slivers refused). The
    answers, the chunks (their sizes: grows), `where` and the LRU order equal after every call."""
    import numpy as np

    from betelgeuse.worker.flex_cache import FlexCache
    L, E, sb = 3, 12, 32
    mk = lambda: FlexCache(sb, sb * 8, 3, L, E, torch.device("cpu"))     # noqa: E731  chunks of 8 slots, room 24

    def ref_take(f, layer, es):                                          # take as it was: _grow asked every time
        where, lru, out = f.where[layer], f.lru, []
        for e in es:
            s = int(where[e])
            if s >= 0:
                lru.move_to_end(s)
                out.append(None)
                continue
            if f.free or f._grow():
                s = f.free.pop(0)
            elif not lru or next(iter(lru)) in out:
                out.append(None)
                continue
            else:
                s = next(iter(lru))
                f._set(s, None)                   # the eviction's forget, then the fill: two steps (take: one)
                f.stats.evictions += 1
            f._set(s, (layer, e))
            out.append(s)
        return out

    f, ref = mk(), mk()
    rng = np.random.default_rng(59)
    grows = 0
    for _ in range(300):
        if rng.random() < 0.15:                   # KV takes part of the room (a sliver left: _grow's quarter rule)
            held = int(rng.choice([0, sb * 3, sb * 7, sb * 13, sb * 18, sb * 22]))
            f.hold(held)
            ref.hold(held)
        layer, n = int(rng.integers(0, L)), int(rng.integers(1, 7))
        es = rng.integers(0, E, n).tolist()
        before = f.nbytes
        assert f.take(layer, es) == ref_take(ref, layer, es)
        grows += f.nbytes > before
        assert [None if c is None else c.numel() for c in f.chunks] == \
            [None if c is None else c.numel() for c in ref.chunks]
        assert (f.where == ref.where).all() and list(f.lru) == list(ref.lru)
        _slot_lists_follow_the_chunks(f)
        _maps_agree(f, ref)
    assert grows > 5 and f.stats.evictions > 50, (grows, f.stats)


def _maps_agree(f, ref):
    """Every map of the copies says the same (FlexCache._set: an eviction's forget and its fill in one call,
    cpu-host62):
    a slot's owner has `where` at that slot and a place in `copies` and the LRU, an empty slot neither; no other
    `where` entry, copy or LRU key; the at-hand log holds every (layer, expert) whose `where` changed since it was
    taken, as the reference's two-step eviction logs them; each eviction counted a forget. Fails where _set leaves the
    evicted copy's where / copies (checked), or logs or counts one side only."""
    held = {s: o for s, o in enumerate(f._owner) if o is not None}
    assert set(f.lru) == set(held), (sorted(f.lru), sorted(held))
    for s, (l, e) in held.items():
        assert f.where[l, e] == s and e in f.copies[l], (s, l, e)
    assert int((f.where >= 0).sum()) == len(held) == sum(len(c) for c in f.copies)
    assert f.changed == ref.changed and f.logged == ref.logged and f.forgets == ref.forgets
    assert f.stats == ref.stats


def _slot_lists_follow_the_chunks(f):
    """FlexCache.views / addresses / sources (made with a chunk, cpu-host61: read by index, no call a slot) name
    each slot of an allocated chunk (a sliver's: its size) by its bytes, and nothing past it nor in a chunk given
    back (hold): fails where _grow or _drop_chunk leaves one of them stale."""
    sb = f.slot_bytes
    for s in range(len(f.views)):
        c, i = divmod(s, f.per_chunk)
        chunk = f.chunks[c]
        if chunk is None or (i + 1) * sb > chunk.numel():
            assert f.views[s] is None and f.addresses[s] == 0 and f.sources[s] is None, s
            continue
        t, o = f.sources[s]
        assert t is chunk and o == i * sb, s
        assert f.addresses[s] == chunk.data_ptr() + i * sb == f.views[s].data_ptr() and f.views[s].numel() == sb, s
