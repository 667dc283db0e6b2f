"""The prefix cache's host tier (issue 24, item 4): blocks the device pool caches are also kept in host memory the
expert store holds (a real memfd here, as in the service); a lookup that misses in the pool but hits there copies
them back, and the logits are the bits of a miss (the miss path itself is checked against the reference model in
test_prefix_cache / test_engine_invariance). The tier is bounded and evicts least recently used entries, never
shares across cache_salt, survives a new mapping of the same memory (a restarted worker), starts empty on a new
one (a restarted store), ignores an entry a killed worker left half written, and counts in the slot plan's memory
budget. The restart of a real worker process: tests/test_cli_serve.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from betelgeuse.config import EngineConfig, MiB
from betelgeuse.errors import BudgetError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.arena import Arena
from betelgeuse.store.plan import HEADROOM, plan_slots
from betelgeuse.worker.prefix_cache import PrefixCache
from betelgeuse.worker.prefix_host import HostTier

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth

V = ENGINE_SPEC["n_vocab"]
C = 8                                             # block = prefill_chunk, small so that prompts span blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("prefix-host") / "engine.gguf", **ENGINE_SPEC)


@pytest.fixture(scope="module")
def runner(model):
    rn, st = in_process_runner(model, 0, 0, prefill_chunk=C)
    yield rn
    close_runner(rn, st)


def _tier(rn, arena: Arena) -> HostTier:
    c = rn.mcfg
    return HostTier(arena, c.n_layer, c.n_head_kv, c.head_dim, C, rn.dtype, V)


def _small_pool(rn) -> PrefixCache:
    """A device pool of 4 blocks and one whole-prompt logits row: one 27-token prompt fills it."""
    c = rn.mcfg
    block_bytes = c.n_layer * 2 * c.n_head_kv * C * c.head_dim * 4
    pc = PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, C, 4 * block_bytes + 4 * V, rn.device, rn.dtype, V)
    assert pc.n_blocks == 4 and pc.tail_logits.shape[0] == 1
    return pc


def _cache(rn, pc, P, salt=""):
    """Prefill P (a miss) and cache its blocks and whole-prompt entry -> its last logits [n_vocab]."""
    kv = rn.new_cache(64)
    logits, _ = rn.forward(P, kv)
    held = pc.insert(kv, P, len(P), [], salt)
    pc.release(pc.insert_tail(kv, P, held, logits[-1], salt))
    return logits[-1]


def test_blocks_back_from_the_host_tier_give_the_bits_of_a_miss(runner):
    rn = runner
    pc = _small_pool(rn)
    with Arena.create(4 * MiB, name="test-prefix") as arena:
        pc.host = _tier(rn, arena)
        a, b = prompt(27, V, seed=1), prompt(27, V, seed=2)    # 3 whole blocks + 3 tokens each
        miss_a = _cache(rn, pc, a)
        _cache(rn, pc, b)                                      # a's 4 blocks leave the device pool
        assert pc.stats.evictions == 4
        assert len(pc.host.index) == 8                         # both prompts are in the host tier
        # the exact repeat: every block and the logits come back from the host; no pass runs
        blocks = pc.lookup(a)
        assert pc.covered(blocks) == len(a) and pc.stats.host_hits == 1 and pc.stats.host_blocks == 4
        assert torch.equal(pc.logits(blocks), miss_a)
        kv = rn.new_cache(64)
        assert pc.load(kv, blocks) == len(a)
        t = int(miss_a.argmax())                               # and the decode after it is a miss's decode
        kv_miss = rn.new_cache(64)
        rn.forward(a, kv_miss)
        want, _ = rn.forward([t], kv_miss, consolidate=False)
        got, _ = rn.forward([t], kv, consolidate=False)
        assert torch.equal(got, want)
        # a prompt that starts with a's whole blocks (now evicted again by b): they come back, the rest is prefilled
        _cache(rn, pc, b)
        longer = a[:24] + prompt(13, V, seed=3)
        blocks = pc.lookup(longer)
        assert len(blocks) == 3 and pc.stats.host_hits == 2
        kv = rn.new_cache(64)
        n = pc.load(kv, blocks)
        hit, _ = rn.forward(longer[n:], kv)
        miss, _ = rn.forward(longer, rn.new_cache(64))
        assert torch.equal(hit, miss), f"a host-tier hit differs from a miss: max |diff| {(hit - miss).abs().max():.3e}"


def test_cache_salt_never_shares_the_host_tier(runner):
    rn = runner
    pc = _small_pool(rn)
    with Arena.create(4 * MiB, name="test-prefix") as arena:
        pc.host = _tier(rn, arena)
        a = prompt(27, V, seed=4)
        _cache(rn, pc, a, salt="tenant-a")
        _cache(rn, pc, prompt(27, V, seed=5))                 # a's blocks leave the device
        assert pc.lookup(a) == [] and pc.lookup(a, salt="tenant-b") == [] and pc.stats.host_hits == 0
        assert pc.covered(pc.lookup(a, salt="tenant-a")) == len(a) and pc.stats.host_hits == 1


def _cpu_tier(arena: Arena, block=2) -> HostTier:
    return HostTier(arena, 2, 1, 4, block, torch.float32, 8)        # 4 KiB slots


def _block(seed: int) -> torch.Tensor:
    return torch.randn((2, 2, 1, 2, 4), generator=torch.Generator().manual_seed(seed))


def test_a_full_host_tier_evicts_the_least_recently_used_entry():
    with Arena.create(5 * 4096) as arena:                    # header, entry table, 3 slots
        tier = _cpu_tier(arena)
        assert tier.n_slots == 3
        keys = [bytes([i]) * 16 for i in range(5)]
        root = b"r" * 16
        for i in range(3):
            assert tier.put(keys[i], root, (i, i), _block(i))
        assert tier.find(keys[0], (0, 0), root) == 0          # 0 used: 1 is now the oldest
        assert tier.find(keys[1], (9, 9), root) is None and tier.find(keys[1], (1, 1), b"x" * 16) is None
        assert tier.put(keys[3], root, (3, 3), _block(3), torch.arange(8.0))
        assert set(tier.index) == {keys[0], keys[2], keys[3]} and tier.bytes_used == tier.capacity_bytes
        kv, logits = torch.zeros(2, 2, 1, 2, 4), torch.zeros(8)
        tier.get(tier.find(keys[3], (3, 3), root), kv, logits)
        assert torch.equal(kv, _block(3)) and torch.equal(logits, torch.arange(8.0)) and tier.whole(tier.index[keys[3]])
        tier.pinned.update(range(3))                          # a lookup reads them all: nothing can go
        assert not tier.put(keys[4], root, (4, 4), _block(4)) and keys[4] not in tier.index


def test_the_tier_outlives_its_writer_and_a_new_store_starts_it_empty():
    with Arena.create(5 * 4096) as arena:
        tier = _cpu_tier(arena)
        root, a, b = b"r" * 16, b"a" * 16, b"b" * 16
        tier.put(a, root, (1, 2), _block(1))
        tier.put(b, root, (3, 4), _block(2))
        del tier
        # a restarted worker maps the same memfd again: it adopts both entries, bit for bit
        again = Arena.attach(os.dup(arena.fd), arena.nbytes, readonly=False)
        tier = _cpu_tier(again)
        assert tier.adopted and set(tier.index) == {a, b}
        kv = torch.zeros(2, 2, 1, 2, 4)
        tier.get(tier.find(b, (3, 4), root), kv)
        assert torch.equal(kv, _block(2))
        # a worker killed while it copied into a slot leaves its entry odd: the next one never reads it
        tier.ent["seq"][tier.index[a]] |= 1
        del tier
        tier = _cpu_tier(again)
        assert set(tier.index) == {b}
        # another geometry (a worker restarted with another prefill_chunk): formatted, nothing is misread
        del tier
        tier = _cpu_tier(again, block=4)
        assert not tier.adopted and tier.index == {}
        del tier
        again.close()
    with Arena.create(5 * 4096) as fresh:                     # a restarted store: a new, zeroed memfd
        tier = _cpu_tier(fresh)
        assert not tier.adopted and tier.index == {} and tier.find(b"b" * 16, (3, 4), b"r" * 16) is None


def test_the_slot_plan_counts_the_host_tier_in_the_memory_budget(model):
    f = GGUFModelFile.open(model)
    try:
        def cfg(**kw):
            return EngineConfig(model_path=str(model), vram_slots=0, host_slots="auto", **kw)
        free_plan = plan_slots(f, cfg(), None)               # no limit: auto = 2 x the device prefix cache
        device = 2 * f.config.n_layer * 2 * f.config.n_head_kv * f.config.head_dim * 4 * 4096
        assert free_plan.prefix_host_bytes == 2 * device
        limit = free_plan.worker_reserve + HEADROOM + 96 * MiB
        plan = plan_slots(f, cfg(), limit)
        free = limit - plan.worker_reserve - HEADROOM
        assert 0 < plan.prefix_host_bytes <= free // 16 and plan.prefix_host_bytes % 4096 == 0
        assert plan.host_bytes == plan.arena_bytes + plan.prefix_host_bytes
        assert plan.host_bytes + plan.worker_reserve + HEADROOM <= limit
        off = plan_slots(f, cfg(prefix_host_bytes=0), limit)  # the memory goes to host expert slots instead
        assert off.prefix_host_bytes == 0 and off.n_host >= plan.n_host
        assert plan_slots(f, cfg(prefix_cache_bytes=0), limit).prefix_host_bytes == 0   # nothing would ever go there
        with pytest.raises(BudgetError, match="prefix host tier"):
            plan_slots(f, EngineConfig(model_path=str(model), vram_slots=0, host_slots=0,
                                       prefix_host_bytes=2 * limit), limit)
    finally:
        f.close()


def test_the_snapshot_tier_round_trips_outlives_its_writer_and_skips_a_torn_entry():
    """worker/snapshot_host.py on the same region protocol: a StateSnapshot (tensors of several dtypes per layer, the
    host state, a whole prompt's logits) comes back bit for bit; a new mapping adopts it; an entry a killed writer
    left odd is never read; a snapshot larger than a slot is not written; another geometry formats the region."""
    from betelgeuse.model.interface import StateSnapshot
    from betelgeuse.worker.snapshot_host import SnapshotHost
    g = torch.Generator().manual_seed(3)
    snap = StateSnapshot(5, [(torch.randn(4, 8, generator=g),),
                             (torch.randn(2, 8, generator=g).bfloat16(), torch.randn(3, 8, generator=g))],
                         np.array([7, 9], dtype=np.int64))
    logits = torch.randn(16, generator=g)
    with Arena.create(64 * 4096) as arena:
        def tier(m=arena, data=4096):
            return SnapshotHost(m, ("t", 2), 32, 16, data)
        t = tier()
        assert t.n_slots >= 2 and not t.adopted
        assert t.put(b"w" * 16, [1, 2, 3, 4, 5], snap, logits) and t.put(b"c" * 16, [1, 2, 3, 4], snap, None)
        big = StateSnapshot(5, [(torch.zeros(256, 256),)], None)                 # 256 KiB > a slot
        assert not t.put(b"b" * 16, [1], big, None) and t.refused == 1
        del t
        again = Arena.attach(os.dup(arena.fd), arena.nbytes, readonly=False)
        t = tier(again)
        assert t.adopted and set(t.index) == {b"w" * 16, b"c" * 16}
        assert t.find(b"w" * 16, [1, 2, 3, 4, 6]) is None                        # its tokens are checked
        got, lg = t.get(t.find(b"w" * 16, [1, 2, 3, 4, 5]), "cpu")
        assert got.length == 5 and np.array_equal(got.host, snap.host) and torch.equal(lg, logits)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for la, lb in zip(got.layers, snap.layers, strict=True)
                   for a, b in zip(la, lb, strict=True))
        assert t.get(t.find(b"c" * 16, [1, 2, 3, 4]), "cpu")[1] is None          # a checkpoint: no logits
        t.ent["seq"][t.index[b"w" * 16]] |= 1                                     # killed mid-copy
        del t
        t = tier(again)
        assert set(t.index) == {b"c" * 16}
        del t
        t = tier(again, data=8192)                                                # another geometry
        assert not t.adopted and t.index == {}
        del t
        again.close()
