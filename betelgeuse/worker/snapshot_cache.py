"""The prefix cache of a model whose state is not per token (model/interface.py prefix_reuse = "snapshots":
deepseek4 and deepseek41, whose compressed entries pool several tokens, whose window is a ring, and deepseek41's
Engram n-gram history, the snapshot's host part): a prompt's whole state is copied
(model.snapshot, a StateSnapshot) and a later prompt that starts with it gets it copied into its fresh state
(model.restore), then prefills the rest. The KVManager drives it as the block cache (worker/prefix_cache.py):

    held = sc.lookup(prompt, salt); sc.acquire(held)   # the longest cached entry that prefixes the prompt
    n = sc.load(state, held)               # its snapshot restored: state.length = n
    sc.watch(state, prompt, n)             # ask the prefill for the state at the prompt's last chunk boundary
    ... prefill prompt[n:] in position-aligned chunks ...
    held = sc.insert(state, prompt, done, held)         # after each pass: that checkpoint, once the pass made it
    held = sc.insert_tail(state, prompt, held, logits)  # after the last pass: the whole prompt with its logits
    sc.release(held)

Two kinds of entry, under the block cache's chained hashes (its _root / _hash, cache_salt the root):
  the whole prompt   the state after every prompt token and the last position's logits: an identical prompt runs
                     no pass (a retry, a regeneration, n completions); when its length is a multiple of `block`, it
                     is a chunk boundary's state too, and a prompt that extends it resumes at its end;
  a checkpoint       the state after the prompt's last chunk boundary b = a multiple of `block` (< the prompt's
                     length), taken by the pass whose chunk ends there (state.mark(b)): a prompt that extends this
                     one (an agent's next turn = this prompt + its answer + new text) restores it and prefills from b.
Exactness: prefill runs in position-aligned chunks, each layer's chunk from that layer's own length, so the chunks
after b are the same ops on the same bits whether the state came from a snapshot or from the prefill of
prompt[:b] in the same request; a hit is bit-identical to a miss (tests/worker/test_snapshot_cache.py). Only
prefill states are snapshotted (a decode step's one-row pass is another computation).

Memory: the snapshots live on the worker's device, counted against the prefix-cache budget (prefix_cache_bytes,
which the slot plan subtracts from VRAM). Entries a running request holds are never evicted; the others go least
recently used first to make room; a snapshot that does not fit even then is refused (PrefixStats.refused, the metric
betelgeuse_prefix_cache_refused_total, logged with its size). Its size is known before any copy (the state's used
rows: snapshot_nbytes), so a refused checkpoint is not marked (its pass copies nothing) and a refused whole prompt is
not copied; for one that fits, room is made before the copy (a checkpoint's at admission: the budget is exceeded
only if other entries take that room while its pass runs). Host tier (worker/snapshot_host.py, in the store's memory): every kept entry is written
through, and a device miss looks there (longest first) and copies a found entry back, so a restarted worker finds
the snapshots its predecessor kept and an evicted entry comes back without a prefill.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from betelgeuse.logs import event
from betelgeuse.worker.prefix_cache import PrefixCache, PrefixStats

log = logging.getLogger("betelgeuse.engine")


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes                      # chained hash of the prefix (whole: of the whole prompt)
    tokens: np.ndarray              # [length] int64: the prefix (checked on a hit: a hash collision never matches)
    snap: object                    # the model's StateSnapshot after `length` tokens
    logits: torch.Tensor | None     # [n_vocab] float32 of the last position: a whole prompt's entry
    nbytes: int
    refs: int = 0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


class SnapshotCache:
    spills = True                   # entries are written through to a host tier (KVManager.bind_host)

    def __init__(self, model, block: int, capacity_bytes: int):
        """model: its snapshot(state) / restore(state, snap); block: the prefill chunk (checkpoints at its
        multiples); capacity_bytes: the budget of every snapshot and logits row held."""
        assert block >= 1 and model.prefix_reuse == "snapshots", (block, model.prefix_reuse)
        self.model, self.block, self.capacity = model, block, int(capacity_bytes)
        self.index: dict[bytes, Entry] = {}
        self.lru: OrderedDict[bytes, Entry] = OrderedDict()     # unheld entries, oldest first
        self.used = 0                                           # bytes of every entry
        self.stats = PrefixStats()
        self.host = None            # worker/snapshot_host.py SnapshotHost in the store's memory, or None

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def bytes_used(self) -> int:
        return self.used

    @property
    def held_blocks(self) -> int:
        """Snapshots some running sequence holds: 0 when the engine is idle."""
        return sum(e.refs > 0 for e in self.index.values())

    @property
    def capacity_bytes(self) -> int:
        return self.capacity

    def _chain(self, prompt: list[int], salt: str, n_blocks: int) -> list[bytes]:
        """The chained hashes of prompt's first 0..n_blocks whole blocks ([0]: the root)."""
        hs, B = [PrefixCache._root(salt)], self.block
        for i in range(n_blocks):
            hs.append(PrefixCache._hash(hs[-1], prompt[i * B:(i + 1) * B]))
        return hs

    def _whole_key(self, prompt: list[int], chain: list[bytes]) -> bytes:
        n_full = (len(prompt) - 1) // self.block
        return PrefixCache._hash(chain[n_full], prompt[n_full * self.block:], whole=True)

    def _match(self, key: bytes, prompt: list[int], n: int) -> Entry | None:
        e = self.index.get(key)
        if e is None or e.length != n or not np.array_equal(e.tokens, np.asarray(prompt[:n], dtype=np.int64)):
            return None
        return e

    # ---- lookup and reference counts --------------------------------------------------------------------
    def lookup(self, prompt: list[int], salt: str = "") -> list[Entry]:
        """[the entry] of the whole prompt, else of its longest cached checkpoint (at least one token left to
        prefill), else []; marked recently used."""
        self.stats.queries += 1
        B, P = self.block, len(prompt)
        chain = self._chain(prompt, salt, (P - 1) // B)
        # longest first: the whole prompt, then at each chunk boundary i * B a checkpoint or a whole earlier prompt
        # of that length (its state is that boundary's); each on the device, else in the host tier
        keys = [(self._whole_key(prompt, chain), P)]
        for i in range(len(chain) - 1, 0, -1):
            keys += [(chain[i], i * B), (PrefixCache._hash(chain[i - 1], prompt[(i - 1) * B:i * B], whole=True), i * B)]
        hit = None
        for key, n in keys:
            hit = self._match(key, prompt, n) or self._from_host(key, prompt, n)
            if hit is not None:
                break
        if hit is None:
            return []
        if hit.key in self.lru:
            self.lru.move_to_end(hit.key)
        self.stats.hits += 1
        self.stats.tokens_reused += hit.length
        return [hit]

    def _from_host(self, key: bytes, prompt: list[int], n: int) -> Entry | None:
        """The host tier's entry under key (prompt[:n] checked), copied back onto the device (an unheld entry), or
        None: not there, or no room on the device for it."""
        slot = None if self.host is None or key in self.index else self.host.find(key, prompt[:n])
        if slot is None:
            return None
        snap, logits = self.host.get(slot, self.model.device)
        held = self._keep(key, prompt[:n], snap, logits, [])
        if not held:
            return None
        self.release(held)
        self.stats.host_hits += 1
        return held[0]

    def covered(self, held: list[Entry]) -> int:
        return held[0].length if held else 0

    def logits(self, held: list[Entry]) -> torch.Tensor | None:
        """The whole prompt's last-position logits [n_vocab] float32 (a copy), or None (a checkpoint, a miss)."""
        return held[-1].logits.clone() if held and held[-1].logits is not None else None

    def acquire(self, held: list[Entry]):
        for e in held:
            e.refs += 1
            self.lru.pop(e.key, None)

    def release(self, held: list[Entry]):
        for e in held:
            e.refs -= 1
            assert e.refs >= 0, e.key
            if e.refs == 0 and self.index.get(e.key) is e:
                self.lru[e.key] = e

    # ---- copies -----------------------------------------------------------------------------------------
    def load(self, state, held: list[Entry]) -> int:
        """The held entry's snapshot restored into a fresh state -> its tokens (0: nothing held)."""
        assert state.length == 0, state.length
        if held:
            self.model.restore(state, held[-1].snap)
        return state.length

    def watch(self, state, prompt: list[int], n: int):
        """Before the prefill of prompt[n:]: have its pass keep the state at the prompt's last chunk boundary
        (the checkpoint an extension of the prompt resumes from), unless that is where it starts, or the copy could
        not be kept (refused now: the pass makes no copy), and with room made for it first (the copy stays within
        the budget unless another entry takes that room meanwhile)."""
        b = (len(prompt) - 1) // self.block * self.block
        if b > n and self._room(state.snapshot_nbytes(b), b):
            state.mark(b)

    def _room(self, nbytes: int, tokens: int) -> bool:
        """Room for an entry of nbytes, unheld entries evicted least recently used first; False (counted as
        refused, nothing evicted) when it would not fit with every unheld entry evicted."""
        held = self.used - sum(e.nbytes for e in self.lru.values())
        if held + nbytes <= self.capacity:
            while self.used + nbytes > self.capacity:
                _, old = self.lru.popitem(last=False)
                self._drop(old)
            return True
        self.stats.refused += 1
        event(log, "snapshot_refused", logging.INFO, tokens=tokens, bytes=nbytes, used=self.used,
              held=held, capacity=self.capacity)
        return False

    def insert(self, state, prompt: list[int], done: int, held: list[Entry], salt: str = "") -> list[Entry]:
        """After a prefill pass: the checkpoint, once a pass has made it (state.take_mark), kept and held."""
        snap = state.take_mark()
        if snap is None:
            return held
        n = snap.length
        chain = self._chain(prompt, salt, n // self.block)
        return self._keep(chain[-1], prompt[:n], snap, None, held)

    def insert_tail(self, state, prompt: list[int], held: list[Entry], logits: torch.Tensor,
                    salt: str = "") -> list[Entry]:
        """After the last prefill pass: the whole prompt's state and its last position's logits [n_vocab]."""
        P = len(prompt)
        if state.length != P or (held and held[-1].length == P):
            return held
        key = self._whole_key(prompt, self._chain(prompt, salt, (P - 1) // self.block))
        if key in self.index:                       # the same prompt finished meanwhile: share its entry
            return self._share(self.index[key], held)
        if not self._room(state.snapshot_nbytes(P) + logits.numel() * logits.element_size(), P):   # before a copy
            return held
        return self._keep(key, prompt, self.model.snapshot(state), logits.reshape(-1).clone(), held)

    def _share(self, e: Entry, held: list[Entry]) -> list[Entry]:
        self.acquire([e])
        return held + [e]

    def _keep(self, key: bytes, toks: list[int], snap, logits: torch.Tensor | None, held: list[Entry]) -> list[Entry]:
        """Index a new entry (held), evicting unheld ones least recently used first; refused when it does not fit."""
        if key in self.index:
            return self._share(self.index[key], held)
        nbytes = snap.nbytes + (0 if logits is None else logits.numel() * logits.element_size())
        if not self._room(nbytes, len(toks)):
            return held
        e = Entry(key, np.asarray(toks, dtype=np.int64), snap, logits, nbytes)
        self.index[key] = e
        self.used += nbytes
        self.stats.inserted += 1
        if self.host is not None:                   # written through (D2H): a restarted worker finds it
            self.host.put(key, toks, snap, logits)
        event(log, "snapshot_kept", logging.DEBUG, tokens=e.length, whole=logits is not None, bytes=nbytes,
              used=self.used, capacity=self.capacity)
        return self._share(e, held)

    def _drop(self, e: Entry):
        del self.index[e.key]
        self.used -= e.nbytes
        self.stats.evictions += 1
