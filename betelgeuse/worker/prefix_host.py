"""The prefix cache's host tier: the blocks of the device pool (worker/prefix_cache.py) are copied here as they are
cached, in host memory the expert store holds: the tier holds more than the pool (evicted blocks come back from
here), and it outlives the worker (a restarted worker finds them) as the arena does.

    tier = HostTier(arena, n_layer, n_head_kv, head_dim, block, dtype, n_vocab)   # formats or adopts the region
    slot = tier.find(h, toks, ph)               # the entry with chained hash h, its tokens and parent hash checked
    tier.put(h, ph, toks, kv_block, logits)     # copy a device block (and a whole prompt's logits) in, D2H
    tier.get(slot, kv_block, logits_row)        # and back, H2D

Who writes: the store creates the memfd (sized by the slot plan within the memory budget, pre-faulted, zeros) and
never writes it while a worker may (it reads it to save it to disk, store/prefix_disk.py, and fills it from there
before any worker attaches); it hands the worker a writable fd with the arena's. Only the attached worker writes (the
store's lease admits one worker at a time, and the worker touches the region only once Attach accepted it), so the
index needs no lock and no protocol: it is a table in the region itself, which a worker adopts when it attaches.
A new store is a new memfd: the tier starts empty, unless [store] prefix_save_path names the file a store saved
it to (then it starts with what that file holds, for the same model and geometry).

Layout: store/prefix_region.py (header, entries, slots; numpy structured arrays over the region). A K/V slot holds
K/V [n_layer, 2, n_head_kv, block, head_dim] in the compute dtype, then the whole prompt's last logits [n_vocab]
float32 (used by whole-prompt entries only).

`seq` is each entry's generation: odd while its slot is being written (the key is cleared first, the bytes
copied, the key set, then it goes even), so a worker killed mid-copy leaves an odd entry that its successor treats
as free: a reader never sees a torn block. `stamp` is a clock bumped per use: the least recently used entry is
evicted first (entries pinned by a lookup in progress are spared). The geometry tag (model shape, block, dtype,
and the numerics: device type, kernels, act_quant, routing mode, schedule) must match, else the region is formatted
anew (a worker started with another dtype, chunk size or routing mode never reads bits it would not compute).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from betelgeuse.store.arena import Arena
from betelgeuse.store.layout import round_up
from betelgeuse.store.prefix_region import HEADER_BYTES, HEADER_DTYPE, MAGIC, VERSION, entry_dtype, fit, valid

class SlotRegion:
    """The layout every host tier shares (module doc): a header, an entry table (`ent`: at least seq, stamp, digest,
    n_tok) and n_slots fixed-size slots; adopted when its magic, version and geometry tag match, else formatted.
    The index maps each whole entry's digest to its slot; the least recently used unpinned slot is the victim.
    HostTier keeps K/V blocks in it, worker/snapshot_host.py whole-state snapshots."""

    def __init__(self, arena: Arena, ent: np.dtype, slot_bytes: int, geometry):
        self.arena, self.slot_bytes = arena, slot_bytes
        n, self.base = fit(arena.nbytes, slot_bytes, ent.itemsize)
        self.n_slots = n
        self.hdr = arena.numpy(0, HEADER_DTYPE.itemsize, dtype=HEADER_DTYPE)[0:1]
        self.ent = arena.numpy(HEADER_BYTES, n * ent.itemsize, dtype=ent) if n else np.zeros(0, dtype=ent)
        tag = hashlib.blake2b(repr(geometry).encode(), digest_size=16).digest()
        h = self.hdr[0]
        self.adopted = (int(h["magic"]) == MAGIC and int(h["version"]) == VERSION and int(h["n_slots"]) == n
                        and int(h["slot_bytes"]) == slot_bytes and bytes(h["tag"]) == tag
                        and int(h["entry_bytes"]) == ent.itemsize)
        if not self.adopted:                     # a new region (zeros), or one another geometry wrote
            self.hdr["magic"] = 0
            self.ent["seq"], self.ent["n_tok"] = 0, 0
            self.hdr["version"], self.hdr["n_slots"], self.hdr["slot_bytes"] = VERSION, n, slot_bytes
            self.hdr["clock"], self.hdr["tag"], self.hdr["entry_bytes"] = 0, tag, ent.itemsize
            self.hdr["magic"] = MAGIC            # last: a region with the magic set is formatted
        # the index: chained hash -> slot, of the entries that are whole (even seq, a key)
        self.index: dict[bytes, int] = {bytes(self.ent["digest"][i]): int(i) for i in np.nonzero(valid(self.ent))[0]}
        self.pinned: set[int] = set()            # slots a lookup is reading: never evicted meanwhile
        self.hits = 0                            # entries copied back to the device
        self.spills = 0                          # entries copied in

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def bytes_used(self) -> int:
        return len(self.index) * self.slot_bytes

    def _touch(self, slot: int):
        self.hdr["clock"] += 1
        self.ent["stamp"][slot] = self.hdr["clock"][0]

    def touch(self, h: bytes):
        """Mark the entry with chained hash h (if any) recently used."""
        slot = self.index.get(h)
        if slot is not None:
            self._touch(slot)

    def _victim(self) -> int | None:
        """A free slot, else the least recently used one not pinned; None when every slot is pinned."""
        if not self.n_slots:
            return None
        free = (self.ent["n_tok"] == 0) | (self.ent["seq"] % 2 == 1)
        stamps = np.where(free, 0, self.ent["stamp"].astype(np.float64))
        if self.pinned:
            stamps[list(self.pinned)] = np.inf
        slot = int(np.argmin(stamps))
        return None if stamps[slot] == np.inf else slot

    def _raw(self, slot: int) -> torch.Tensor:
        """The slot's bytes (uint8 [slot_bytes], a view)."""
        return self.arena.torch(self.base + slot * self.slot_bytes, self.slot_bytes)

    def _begin_write(self, h: bytes) -> int | None:
        """A slot for a new entry under h, its old entry dropped and its seq odd (being written); None: every slot
        is pinned. The caller copies the bytes, sets the entry's fields, then _end_write."""
        slot = self._victim()
        if slot is None:
            return None
        e = self.ent
        e["seq"][slot] |= 1                      # odd: being written (a successor would treat it as free)
        old = bytes(e["digest"][slot])
        if self.index.get(old) == slot:
            del self.index[old]
        e["n_tok"][slot] = 0
        return slot

    def _end_write(self, slot: int, h: bytes, n_tok: int):
        e = self.ent
        e["digest"][slot], e["n_tok"][slot] = h, n_tok
        self._touch(slot)
        e["seq"][slot] += 1                      # even: whole
        self.index[h] = slot
        self.spills += 1


class HostTier(SlotRegion):
    def __init__(self, arena: Arena, n_layer: int, n_head_kv: int, head_dim: int, block: int, dtype: torch.dtype,
                 n_vocab: int, numerics: tuple = ()):
        self.kv_shape = (n_layer, 2, n_head_kv, block, head_dim)
        self.dtype = dtype
        self.kv_bytes = int(np.prod(self.kv_shape)) * torch.empty((), dtype=dtype).element_size()
        self.n_vocab = n_vocab
        super().__init__(arena, entry_dtype(block), round_up(self.kv_bytes + 4 * n_vocab),
                         (self.kv_shape, str(dtype), n_vocab) + tuple(numerics))

    def _views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's K/V [n_layer, 2, n_head_kv, block, head_dim] and logits [n_vocab] float32 (views)."""
        raw = self._raw(slot)
        kv = raw[:self.kv_bytes].view(self.dtype).view(self.kv_shape)
        return kv, raw[self.kv_bytes:self.kv_bytes + 4 * self.n_vocab].view(torch.float32)

    def find(self, h: bytes, toks: tuple, ph: bytes) -> int | None:
        """The entry with chained hash h whose own tokens and parent's hash are also the prompt's (a hash collision
        never matches), marked recently used."""
        slot = self.index.get(h)
        if slot is None:
            return None
        e = self.ent[slot]
        n = int(e["n_tok"])
        # digests are 16 raw bytes in the region (a chain's root, b"", reads back as 16 zeros)
        if n != len(toks) or bytes(e["pdigest"]) != ph.ljust(16, b"\0") or tuple(e["tokens"][:n].tolist()) != toks:
            return None
        self._touch(slot)
        return slot

    def whole(self, slot: int) -> bool:
        return bool(self.ent["whole"][slot])

    def tokens(self, slot: int) -> tuple:
        return tuple(self.ent["tokens"][slot][:int(self.ent["n_tok"][slot])].tolist())

    def put(self, h: bytes, ph: bytes, toks: tuple, kv: torch.Tensor, logits: torch.Tensor | None = None) -> bool:
        """Copy in a device block kv [n_layer, 2, n_head_kv, block, head_dim] (its first len(toks) positions
        matter) under chained hash h (parent's hash ph), with a whole prompt's last `logits` [n_vocab]. An entry
        already there is only marked used. False: every slot is pinned (nothing is written)."""
        if h in self.index:
            self._touch(self.index[h])
            return True
        slot = self._begin_write(h)
        if slot is None:
            return False
        e = self.ent
        dst_kv, dst_logits = self._views(slot)
        dst_kv.copy_(kv)                         # D2H, synchronous: the bytes are there before the entry is
        if logits is not None:
            dst_logits.copy_(logits.reshape(-1))
        e["pdigest"][slot], e["whole"][slot] = ph, int(logits is not None)
        e["tokens"][slot][:len(toks)] = toks
        self._end_write(slot, h, len(toks))
        return True

    def get(self, slot: int, kv: torch.Tensor, logits: torch.Tensor | None = None):
        """Copy an entry back into a device block kv [n_layer, 2, n_head_kv, block, head_dim] (H2D), and its
        logits into `logits` [n_vocab] for a whole prompt's entry."""
        src_kv, src_logits = self._views(slot)
        kv.copy_(src_kv)
        if logits is not None:
            logits.copy_(src_logits)
        self.hits += 1
