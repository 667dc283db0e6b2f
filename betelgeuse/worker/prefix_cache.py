"""The KV prefix cache: K/V of prompt blocks kept after their prefill, indexed by the hash of the whole prefix
up to each block (vLLM's automatic prefix caching), reused by later requests that start with the same tokens.

    blocks = pc.lookup(prompt)             # longest cached chain of full blocks (at least one prompt token left)
    pc.acquire(blocks); n = pc.load(kv, blocks)    # copy them into the sequence's KV cache: kv.length = n
    ... prefill prompt[n:] ...
    held = pc.insert(kv, prompt, done, held)       # the new full blocks of prompt[:done] (copied in), held too
    held = pc.insert_tail(kv, prompt, held, logits)  # after the last pass: the whole prompt (see below)
    pc.release(held)                       # the request ended: its blocks become evictable (LRU)

A block is `block` tokens (= EngineConfig.prefill_chunk), aligned to absolute positions: the engine prefills in
position-aligned chunks, so a block's K/V are the same bits whichever request computed it, and a prefix hit gives
logits bit-identical to a miss (tests/worker/test_prefix_cache.py). Only prompt blocks are cached: K/V written by decode
steps come from one-row passes and would not match what a prefill computes for the same tokens.

The whole prompt: after its last prefill pass a request also keeps its prompt's last, partial block (1..block
tokens) and the logits of its last position, under the hash of the whole prompt. A later request with exactly the
same prompt loads every block and runs no pass at all: its first token is sampled from the same logits a miss
computes (bit-identical: they are that miss's logits), so a repeated prompt (a retry, a regeneration, n
completions) costs a copy. A prompt that only starts with a cached one still prefills from its last whole block.

cache_salt: a request's salt is the root of its chain's hashes, so prompts under different salts never share an
entry (vLLM's cache_salt: one tenant cannot learn from its time to first token what another has sent).

Memory: one preallocated pool [n_layer, 2, n_blocks, n_head_kv, block, head_dim] on the worker's device, its size
the configured budget (the slot plan subtracts it from the VRAM budget), less the whole-prompt logits rows
[n_tails, n_vocab] float32 preallocated beside it. Blocks held by a running request
(reference count > 0) are never evicted; the others are evicted least recently used first, the tail of a chain
before its head (a head evicted first would leave its tail unreachable).

The host tier (worker/prefix_host.py, `host`; None: none), in host memory that the expert store holds: every block
the pool takes (a whole prompt's entry with its logits) is also copied there as it is inserted (write-through: a
worker killed by SIGKILL cannot flush anything, and the copy is a few milliseconds beside the prefill that made the
block); an evicted block the host tier has dropped meanwhile is copied again. A lookup that runs out of device
blocks goes on in the host tier; the blocks it finds are copied back into the pool (promoted, as if just inserted),
so everything after the lookup sees device blocks only. The bits are the ones the device held: a hit from the host
is as exact as one from the device. The device keeps a chain's head longer than its tail, so the host tier holds
the rest of a chain, or all of it after a restart.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from betelgeuse.worker.prefix_host import HostTier


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0            # lookups (one per request that prefills)
    hits: int = 0               # lookups that reused at least one block
    tokens_reused: int = 0      # prompt tokens served from the cache
    inserted: int = 0           # blocks written
    evictions: int = 0          # blocks dropped to make room
    host_hits: int = 0          # lookups that reused at least one block from the host tier
    host_blocks: int = 0        # blocks copied back from the host tier
    refused: int = 0            # entries that did not fit (worker/snapshot_cache.py)


class PrefixCache:
    spills = True                   # evicted blocks go to a host tier (KVManager.bind_host)

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, block: int, capacity_bytes: int,
                 device, dtype, n_vocab: int = 0):
        """n_vocab: the logits row of a whole-prompt entry (0: no whole-prompt entries)."""
        assert block >= 1
        self.block = block
        elt = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = n_layer * 2 * n_head_kv * block * head_dim * elt
        # whole-prompt entries: at most one per 4 blocks (each also holds a block), 16 at most, within the budget
        n_tails = min(16, capacity_bytes // self.block_bytes // 4) if n_vocab else 0
        if n_vocab and not n_tails and capacity_bytes >= self.block_bytes + 4 * n_vocab:
            n_tails = 1
        self.tail_logits = torch.zeros((n_tails, n_vocab), dtype=torch.float32, device=device)
        self.tail_row: dict[int, int] = {}                          # whole-prompt block id -> its logits row
        self.tail_free = list(range(n_tails - 1, -1, -1))
        self.n_blocks = (capacity_bytes - self.tail_logits.numel() * 4) // self.block_bytes
        # [n_layer, 2 (k, v), n_blocks, n_head_kv, block, head_dim]
        self.pool = torch.zeros((n_layer, 2, self.n_blocks, n_head_kv, block, head_dim), dtype=dtype, device=device)
        self.digest: list[bytes | None] = [None] * self.n_blocks      # chained hash of the prefix ending here
        self.pdigest: list[bytes | None] = [None] * self.n_blocks     # ... and of the prefix before it (the root)
        self.tokens: list[tuple | None] = [None] * self.n_blocks      # the block's own tokens (checked on a hit)
        self.parent = np.full(self.n_blocks, -1, dtype=np.int64)     # the block before it (-1 = the first block)
        self.refs = np.zeros(self.n_blocks, dtype=np.int64)
        self.index: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()              # unreferenced cached blocks, oldest first
        self.free = list(range(self.n_blocks - 1, -1, -1))
        self.stats = PrefixStats()
        self.host: HostTier | None = None        # where evicted blocks go (set by the owner: KVManager)

    @property
    def enabled(self) -> bool:
        return self.n_blocks > 0

    @property
    def bytes_used(self) -> int:
        return (self.n_blocks - len(self.free)) * self.block_bytes + len(self.tail_row) * self.tail_logits.shape[1] * 4

    @property
    def held_blocks(self) -> int:
        """Blocks some running sequence holds (acquired, not released): 0 when the engine is idle."""
        return int((self.refs > 0).sum())

    @property
    def capacity_bytes(self) -> int:
        return self.n_blocks * self.block_bytes + self.tail_logits.numel() * 4

    @staticmethod
    def _root(salt: str) -> bytes:
        """The chain's start: b"" for the shared cache, a hash of the salt for a request's own (cache_salt)."""
        return hashlib.blake2b(b"S" + salt.encode(), digest_size=16).digest() if salt else b""

    @staticmethod
    def _hash(parent: bytes, toks, whole: bool = False) -> bytes:
        """The chained hash of a prefix; `whole` marks the end of a whole prompt (never equal to a block's)."""
        return hashlib.blake2b((b"W" if whole else b"") + parent + np.asarray(toks, dtype=np.int64).tobytes(),
                               digest_size=16).digest()

    def _find(self, h: bytes, toks: tuple, parent: int) -> int | None:
        """The cached block with chained hash h, if its own tokens and the block before it are also the prompt's
        (a hash collision or a re-used parent id never matches)."""
        blk = self.index.get(h)
        if blk is None or self.tokens[blk] != toks or self.parent[blk] != parent:
            return None
        return blk

    # ---- lookup and reference counts --------------------------------------------------------------------
    def lookup(self, prompt: list[int], salt: str = "") -> list[int]:
        """Block ids of the longest cached prefix of `prompt` in whole blocks, leaving at least one token to
        prefill (its logits start the generation), or the whole prompt's entry. Marks them recently used.
        salt: only entries inserted with the same salt match."""
        self.stats.queries += 1
        out, h, parent = [], self._root(salt), -1     # h: the chained hash of the prefix matched so far
        B = self.block
        n_full = (len(prompt) - 1) // B
        for i in range(n_full):
            toks = tuple(prompt[i * B:(i + 1) * B])
            blk = self._find(self._hash(h, toks), toks, parent)
            if blk is None:
                break
            out.append(blk)
            parent, h = blk, self.digest[blk]
            if self.host is not None:
                self.host.touch(h)                  # used: the host tier keeps it longer too
        host: list[tuple[int, bytes, bytes, tuple]] = []     # (host slot, hash, parent's hash, tokens)
        for i in range(len(out), n_full if self.host is not None else 0):
            toks = tuple(prompt[i * B:(i + 1) * B])
            slot = self.host.find(self._hash(h, toks), toks, h)
            if slot is None:
                break
            host.append((slot, self._hash(h, toks), h, toks))
            h = host[-1][1]
        if len(out) + len(host) == n_full:             # every whole block: the whole prompt too?
            toks = tuple(prompt[n_full * B:])
            hw = self._hash(h, toks, whole=True)
            blk = self._find(hw, toks, parent) if self.tail_row and not host else None
            if blk is not None:
                out.append(blk)
            elif self.host is not None and self.tail_logits.shape[0]:
                slot = self.host.find(hw, toks, h)
                if slot is not None:
                    host.append((slot, hw, h, toks))
        if host:
            got = self._promote(out, host)
            out += got
            self.stats.host_hits += bool(got)
            self.stats.host_blocks += len(got)
        for blk in reversed(out):                   # head most recent: the tail goes first
            if blk in self.lru:
                self.lru.move_to_end(blk)
        if out:
            self.stats.hits += 1
            self.stats.tokens_reused += self.covered(out)
        return out

    def _promote(self, chain: list[int], host: list[tuple[int, bytes, bytes, tuple]]) -> list[int]:
        """Copy host entries (the continuation of the device blocks `chain`) into device blocks, in order, while
        there is room -> their block ids. The chain is held meanwhile (evictions for room spill other blocks to
        the host, never the entries being read: they are pinned there)."""
        self.acquire(chain)
        self.host.pinned.update(slot for slot, *_ in host)
        new: list[int] = []
        try:
            for slot, h, ph, toks in host:
                row = self._tail_row() if self.host.whole(slot) else None
                if self.host.whole(slot) and row is None:
                    break
                blk = self._allocate()
                if blk is None:
                    if row is not None:
                        self.tail_free.append(row)
                    break
                parent = (chain + new)[-1] if chain or new else -1
                self.digest[blk], self.pdigest[blk], self.tokens[blk], self.parent[blk] = h, ph, toks, parent
                self.index[h] = blk
                if row is not None:
                    self.tail_row[blk] = row
                self.host.get(slot, self.pool[:, :, blk], None if row is None else self.tail_logits[row])
                self.acquire([blk])
                new.append(blk)
        finally:
            self.host.pinned.clear()
            self.release(chain + new)
        return new

    def covered(self, blocks: list[int]) -> int:
        """Prompt tokens a lookup's chain holds: what load() will copy in (the whole prompt's entry counts its own)."""
        tail = blocks[-1] if blocks and blocks[-1] in self.tail_row else None
        return (len(blocks) - 1) * self.block + len(self.tokens[tail]) if tail is not None else len(blocks) * self.block

    def logits(self, blocks: list[int]) -> torch.Tensor | None:
        """The last position's logits [n_vocab] float32 (a copy) when `blocks` end with a whole prompt, else None."""
        row = self.tail_row.get(blocks[-1]) if blocks else None
        return None if row is None else self.tail_logits[row].clone()

    def acquire(self, blocks: list[int]):
        for blk in blocks:
            self.refs[blk] += 1
            self.lru.pop(blk, None)

    def release(self, blocks: list[int]):
        """A request is done with its chain: blocks nobody holds become evictable, the tail before the head."""
        for blk in reversed(blocks):
            self.refs[blk] -= 1
            assert self.refs[blk] >= 0, blk
            if self.refs[blk] == 0 and self.digest[blk] is not None:
                self.lru[blk] = None

    # ---- copies -----------------------------------------------------------------------------------------
    def load(self, kv, blocks: list[int]) -> int:
        """Copy the blocks' K/V into positions [0, n*block) of an empty sequence cache; returns n*block tokens."""
        assert kv.length == 0, kv.length
        tail = blocks[-1] if blocks and blocks[-1] in self.tail_row else None
        full = blocks[:-1] if tail is not None else blocks
        n, B = len(full), self.block
        t = len(self.tokens[tail]) if tail is not None else 0
        if n:
            idx = torch.tensor(full, dtype=torch.long, device=self.pool.device)
        for l in range(self.pool.shape[0]):
            for j, dst in enumerate((kv.k[l], kv.v[l])):
                kvh, _, hd = dst.shape
                if n:       # [n, kvh, B, hd] -> the cache's [kvh, n*B, hd] layout
                    dst[:, :n * B].view(kvh, n, B, hd).copy_(self.pool[l, j].index_select(0, idx).transpose(0, 1))
                if t:       # the whole prompt's last t tokens
                    dst[:, n * B:n * B + t].copy_(self.pool[l, j, tail, :, :t])
        kv.length = n * B + t
        return kv.length

    def watch(self, kv, prompt: list[int], n: int):
        """Before the prefill of prompt[n:] (nothing: insert copies every new block from the state after its pass)."""

    def insert(self, kv, prompt: list[int], done: int, held: list[int], salt: str = "") -> list[int]:
        """After a prefill pass: cache the full blocks of prompt[:done] past `held` (the chain this request
        already holds: matched or inserted before), copying their K/V from kv. Returns the new chain, all held.
        A block someone else inserted meanwhile is shared, not copied; a full cache of held blocks stops here."""
        B = self.block
        chain = list(held)
        h = self.digest[chain[-1]] if chain else self._root(salt)
        new: list[tuple[int, int]] = []                 # (block id, block index in the prompt) to copy
        for i in range(len(chain), done // B):
            toks = tuple(prompt[i * B:(i + 1) * B])
            ph, h = h, self._hash(h, toks)
            parent = chain[-1] if chain else -1
            blk = self._find(h, toks, parent)
            if blk is None:
                blk = self._allocate()
                if blk is None:
                    break
                new.append((blk, i))
                self.digest[blk], self.pdigest[blk], self.tokens[blk], self.parent[blk] = h, ph, toks, parent
                self.index[h] = blk
                self.stats.inserted += 1
            self.acquire([blk])
            chain.append(blk)
        if new:
            self._write(kv, new, done // B)
            for blk, _ in new:
                self._to_host(blk)
        return chain

    def insert_tail(self, kv, prompt: list[int], held: list[int], logits: torch.Tensor, salt: str = "") -> list[int]:
        """After the last prefill pass: keep the whole prompt (its last 1..block tokens' K/V from kv and `logits`
        [n_vocab], its last position's) when `held` holds its chain of whole blocks. Returns the chain, the new
        entry held too; unchanged when there is no room (no logits row or block that nobody holds)."""
        B, P = self.block, len(prompt)
        n_full = (P - 1) // B
        # (a prompt of whole blocks holds its last one as a block too: the entry hangs off the block before it)
        if not self.tail_logits.shape[0] or len(held) < n_full or kv.length < P:
            return held
        toks = tuple(prompt[n_full * B:])
        parent = held[n_full - 1] if n_full else -1
        ph = self.digest[parent] if n_full else self._root(salt)
        h = self._hash(ph, toks, whole=True)
        blk = self._find(h, toks, parent)
        if blk is not None:
            self.acquire([blk])                     # the same prompt finished meanwhile: share its entry
            return held + [blk]
        row = self._tail_row()
        if row is None:
            return held
        blk = self._allocate()
        if blk is None:
            self.tail_free.append(row)
            return held
        self.tail_row[blk] = row
        self.digest[blk], self.pdigest[blk], self.tokens[blk], self.parent[blk] = h, ph, toks, parent
        self.index[h] = blk
        self.stats.inserted += 1
        self.tail_logits[row].copy_(logits.reshape(-1))
        t = len(toks)
        for l in range(self.pool.shape[0]):
            for j, src in enumerate((kv.k[l], kv.v[l])):
                self.pool[l, j, blk, :, :t].copy_(src[:, n_full * B:P])
        self._to_host(blk)
        self.acquire([blk])
        return held + [blk]

    def _tail_row(self) -> int | None:
        """A logits row for a whole-prompt entry: a free one, else the oldest evictable entry's (it goes)."""
        if not self.tail_free:
            old = next((b for b in self.lru if b in self.tail_row), None)
            if old is None:
                return None
            self.lru.pop(old)
            self._drop(old)
            self.free.append(old)
        return self.tail_free.pop()

    def _allocate(self) -> int | None:
        if self.free:
            return self.free.pop()
        if not self.lru:
            return None
        blk, _ = self.lru.popitem(last=False)
        self._drop(blk)
        return blk

    def _drop(self, blk: int):
        """Forget an evicted block (and its logits row if it ends a whole prompt), spilled to the host tier first."""
        if self.digest[blk] is not None:
            self._to_host(blk)                      # (a copy only if the host tier dropped it meanwhile)
        self.index.pop(self.digest[blk], None)
        self.digest[blk], self.pdigest[blk], self.tokens[blk], self.parent[blk] = None, None, None, -1
        row = self.tail_row.pop(blk, None)
        if row is not None:
            self.tail_free.append(row)
        self.stats.evictions += 1

    def _to_host(self, blk: int):
        """Copy a cached block (and a whole prompt's logits) into the host tier, if there is one."""
        if self.host is not None:
            row = self.tail_row.get(blk)
            self.host.put(self.digest[blk], self.pdigest[blk], self.tokens[blk], self.pool[:, :, blk],
                          None if row is None else self.tail_logits[row])

    def _write(self, kv, new: list[tuple[int, int]], n_full: int):
        """Copy prompt blocks new[j][1] of kv into pool blocks new[j][0]: two gathers + two scatters per layer."""
        B, dev = self.block, self.pool.device
        dst = torch.tensor([b for b, _ in new], dtype=torch.long, device=dev)
        src = torch.tensor([i for _, i in new], dtype=torch.long, device=dev)
        for l in range(self.pool.shape[0]):
            for j, t in enumerate((kv.k[l], kv.v[l])):
                kvh, _, hd = t.shape
                blocks = t[:, :n_full * B].view(kvh, n_full, B, hd).transpose(0, 1)     # [n_full, kvh, B, hd]
                self.pool[l, j].index_copy_(0, dst, blocks.index_select(0, src))
