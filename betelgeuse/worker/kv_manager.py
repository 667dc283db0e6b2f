"""A sequence's memory in the worker: its KV cache (the model's per-sequence state, runner.new_cache) and its entries
in the prefix cache, whose counters go to the metrics (vLLM's KV cache manager). The prefix cache is the model's
kind (model/interface.py prefix_reuse): K/V blocks (worker/prefix_cache.py) or whole-state snapshots
(worker/snapshot_cache.py); both answer the same calls.

    n = kvm.hit(seq)         # at admission (the scheduler's prefix_hit): the longest cached prefix, held for seq
    kvm.admit(seq)           # its KV cache sized to what the request can use, the held prefix copied in (and the
                             # prefill asked for the state a snapshot cache keeps: SnapshotCache.watch)
    kvm.make_room(seq)       # before a decode pass: a state that is full grows (doubles, up to max_context)
    kvm.prefilled(seq, logits)   # after each prefill pass: its new whole blocks; the whole prompt after the last
    kvm.free(seq)            # it ended: its KV cache goes (the runner's graphs of it: runner.request_done), its blocks
                             # become evictable
    kvm.bind_host()          # after each (re)attach: the prefix cache's host tier in the store's memory

A sequence's state is sized to what it can use, in whole granules of KV_GRANULE tokens up to max_context: the prompt
+ max_tokens where the request bounds its output; where it does not (max_tokens unset: until EOS or the context) and
the model's state grows (model/interface.py state_grows), the prompt + one granule, doubled when a decode reaches its
end. The plan reserves max_running full-context states; what the running ones do not take is the flex expert cache's
(worker/flex_cache.py), so a short request leaves nearly all of its reservation to cached experts.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from betelgeuse.config import EngineConfig
from betelgeuse.logs import event
from betelgeuse.model.registry import arch_of
from betelgeuse.store.plan import prefix_cache_bytes
from betelgeuse.worker.prefix_cache import PrefixCache, PrefixStats
from betelgeuse.worker.prefix_host import HostTier
from betelgeuse.worker.sequence import Sequence
from betelgeuse.worker.snapshot_cache import SnapshotCache
from betelgeuse.worker.snapshot_host import SnapshotHost

log = logging.getLogger("betelgeuse.engine")

# tokens: a sequence state's size is a multiple of this (or max_context); an unbounded request's first output room
KV_GRANULE = 256


class KVManager:
    def __init__(self, cfg: EngineConfig, runner, metrics=None):
        self.runner, self.metrics = runner, metrics
        self.prefix = self._make_prefix_cache(cfg)      # None: off, or not possible for this model/schedule
        self._exported = PrefixStats()                  # prefix-cache counters already added to the metrics
        self.bind_host()

    def bind_host(self):
        """The prefix cache's host tier in the store's memory of the current attachment (worker/prefix_host.py):
        adopted with the blocks it holds (a restarted worker), or formatted (a new store). None: no tier."""
        pc, arena = self.prefix, self.runner.session.prefix_arena
        if pc is None or not pc.spills:
            return
        pc.host = None
        if arena is not None:
            r, c = self.runner, self.runner.mcfg
            # what else decides a block's bits: a tier written under other numerics (a restarted worker or service
            # with another routing mode, kernel path or device) is formatted, never adopted
            num = (r.device.type, r.cfg.kernels, r.cfg.act_quant, r.cfg.routing, r.cfg.schedule)
            if isinstance(pc, SnapshotCache):
                # a slot holds a whole context's state: the registry's state_bytes bounds any snapshot
                dt = torch.empty((), dtype=r.dtype).element_size()
                pc.host = SnapshotHost(arena, (c.arch, c.n_layer, c.n_embd, str(r.dtype), pc.block) + num,
                                       r.cfg.max_context, c.n_vocab, arch_of(c).state_bytes(c, r.cfg.max_context, dt))
            else:
                pc.host = HostTier(arena, c.n_layer, c.n_head_kv, c.head_dim, pc.block, pc.pool.dtype,
                                   pc.tail_logits.shape[1], num)
            event(log, "prefix_host_tier", slots=pc.host.n_slots, bytes=pc.host.capacity_bytes,
                  adopted_blocks=len(pc.host.index))
        if self.metrics:
            self.metrics.prefix_host_capacity.set(pc.host.capacity_bytes if pc.host else 0)
        self._export()

    def _make_prefix_cache(self, cfg: EngineConfig) -> PrefixCache | SnapshotCache | None:
        r, c = self.runner, self.runner.mcfg
        elt = torch.empty((), dtype=r.dtype).element_size()
        nbytes = prefix_cache_bytes(cfg, c, elt)
        reuse = r.model.prefix_reuse
        if nbytes == 0 or reuse == "none":
            return None
        if r.chunk is None or cfg.schedule != "layer_major":
            log.info("prefix cache off: %s", "the standard schedule prefills in micro-batches"
                     if r.chunk is not None else f"{c.arch} state is not prefilled in position-aligned chunks")
            return None
        if reuse == "snapshots":
            sc = SnapshotCache(r.model, r.chunk, nbytes)
            event(log, "prefix_cache", logging.INFO, kind="snapshots", checkpoint_tokens=sc.block,
                  bytes=sc.capacity_bytes, device=str(r.device))
            if self.metrics:
                self.metrics.prefix_cache_capacity.set(sc.capacity_bytes)
            return sc
        pc = PrefixCache(c.n_layer, c.n_head_kv, c.head_dim, r.chunk, nbytes, r.device, r.dtype, c.n_vocab)
        if not pc.enabled:
            log.warning("prefix cache off: %d bytes hold no block of %d tokens (%d bytes)", nbytes, r.chunk,
                        pc.block_bytes)
            return None
        event(log, "prefix_cache", logging.INFO, blocks=pc.n_blocks, block_tokens=pc.block,
              bytes=pc.capacity_bytes, device=str(r.device))
        if self.metrics:
            self.metrics.prefix_cache_capacity.set(pc.capacity_bytes)
        return pc

    def hit(self, seq: Sequence) -> int:
        """The longest cached prefix of the prompt, held for the sequence (seq.blocks) -> its tokens (0: a miss).
        A whole cached prompt (every token) needs no pass: its first token comes from cached_logits."""
        pc = self.prefix
        blocks = pc.lookup(seq.prompt_ids, seq.request.cache_salt)
        pc.acquire(blocks)
        seq.blocks = blocks
        return pc.covered(blocks)

    def state_size(self, tokens: int) -> int:
        """Tokens of a state holding `tokens`: whole granules, at most max_context (what admit allocates)."""
        return self._size(tokens)

    def _size(self, tokens: int) -> int:
        """Tokens of a state holding `tokens`: whole granules, at most max_context."""
        return min(self.runner.cfg.max_context, -(-tokens // KV_GRANULE) * KV_GRANULE)

    def admit(self, seq: Sequence):
        """The sequence's KV cache for its prompt and its output (module doc: all of it where the request bounds
        it, else a first granule that grows); the held prefix copied into it."""
        out = seq.max_tokens
        if seq.request.max_tokens is None and self.runner.model.state_grows:
            out = min(out, KV_GRANULE)
        seq.kv = self.runner.new_cache(self._size(len(seq.prompt_ids) + out))
        if self.prefix is not None:
            n = self.prefix.load(seq.kv, seq.blocks)
            assert n == seq.n_done, (n, seq.n_done)         # what the scheduler planned from hit()
            seq.usage.cached_tokens = n
            self.prefix.watch(seq.kv, seq.prompt_ids, n)
            self._export()

    def make_room(self, seq: Sequence, tokens: int = 1):
        """Before a pass appends `tokens` to the sequence: a state without room for them is grown (twice its size,
        up to max_context; runner.grow_cache), replacing seq.kv."""
        kv = seq.kv
        if kv.length + tokens <= kv.max_len:
            return
        seq.kv = self.runner.grow_cache(kv, self._size(max(kv.length + tokens, 2 * kv.max_len)))

    def cached_logits(self, seq: Sequence) -> torch.Tensor:
        """The whole cached prompt's last-position logits [n_vocab] float32."""
        return self.prefix.logits(seq.blocks)

    def prefilled(self, seq: Sequence, logits: torch.Tensor):
        """After a prefill pass gave seq.n_done prompt tokens: the prompt's new whole blocks go into the prefix
        cache, and after its last piece the whole prompt with its last position's logits [n_vocab]."""
        pc = self.prefix
        if pc is None:
            return
        salt, P = seq.request.cache_salt, seq.prompt_ids
        seq.blocks = pc.insert(seq.kv, P, seq.n_done, seq.blocks, salt)
        if not seq.prefilling:
            seq.blocks = pc.insert_tail(seq.kv, P, seq.blocks, logits, salt)
        self._export()

    def free(self, seq: Sequence):
        """The sequence ended: it lets go of its KV cache, and its prefix blocks become evictable."""
        blocks = seq.blocks
        seq.kv, seq.blocks = None, []
        if blocks and self.prefix is not None:
            self.prefix.release(blocks)
            self._export()

    def _export(self):
        """The prefix cache's own counters (PrefixStats) into the metrics: what grew since the last export."""
        m, pc = self.metrics, self.prefix
        if not m or pc is None:
            return
        st, old = pc.stats, self._exported
        m.prefix_cache_queries.inc(st.queries - old.queries)
        m.prefix_cache_hits.inc(st.hits - old.hits)
        m.prefix_cache_tokens.inc(st.tokens_reused - old.tokens_reused)
        m.prefix_cache_evictions.inc(st.evictions - old.evictions)
        m.prefix_cache_refused.inc(st.refused - old.refused)
        m.prefix_cache_bytes.set(pc.bytes_used)
        m.prefix_cache_usage.set(pc.bytes_used / pc.capacity_bytes if pc.capacity_bytes else 0.0)
        m.prefix_cache_held.set(pc.held_blocks)
        m.prefix_host_hits.inc(st.host_hits - old.host_hits)
        m.prefix_host_bytes.set(pc.host.bytes_used if pc.host else 0)
        self._exported = dataclasses.replace(st)
