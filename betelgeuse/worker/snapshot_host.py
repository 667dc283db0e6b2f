"""The snapshot cache's host tier (worker/snapshot_cache.py: deepseek4, deepseek41): every snapshot the device cache
keeps is written through to host memory the expert store holds, so a restarted worker (a `kill -9`, a crash)
finds them, and an entry evicted from the device comes back from here. The region and its protocol are the K/V
block tier's (worker/prefix_host.py SlotRegion: header, entry table, fixed slots, odd seq while written so a worker
killed mid-copy leaves nothing readable, LRU victims, a geometry tag that formats the region anew when it differs).

    tier = SnapshotHost(arena, geometry, max_tokens, n_vocab, data_bytes)
    tier.put(key, tokens, snap, logits)     # D2H: a StateSnapshot (and a whole prompt's last logits)
    slot = tier.find(key, tokens)           # the entry under the chained hash key whose tokens are these
    snap, logits = tier.get(slot, device)   # H2D: a StateSnapshot on the device (logits None: a checkpoint)

A slot holds one snapshot of at most max_tokens tokens (the context): its tokens int32 [max_tokens], the logits
float32 [n_vocab], the host state (deepseek41's Engram history: int64 [HOST_MAX]), a descriptor per tensor
int64 [MAX_TENSORS, 4] = (layer, rows, cols, dtype code) and the tensors' bytes, each 64-byte aligned, within
data_bytes (the state of a whole context: the registry's state_bytes bounds every snapshot). Slots are as large as
the largest snapshot: a short prompt's entry leaves most of its slot unused.
"""

from __future__ import annotations

import numpy as np
import torch

from betelgeuse.model.interface import StateSnapshot
from betelgeuse.store.layout import round_up
from betelgeuse.worker.prefix_host import SlotRegion

HOST_MAX = 32                   # int64 values of host state (deepseek41: the Engram history, max_ngram - 1)
MAX_TENSORS = 512               # tensors per snapshot (deepseek4: <= 7 a layer, deepseek41 <= 5)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN = 64

ENTRY = np.dtype([("seq", "<u8"), ("stamp", "<u8"), ("digest", "V16"), ("n_tok", "<i4"), ("whole", "<i4"),
                  ("n_ten", "<i4"), ("n_host", "<i4")])


class SnapshotHost(SlotRegion):
    def __init__(self, arena, geometry, max_tokens: int, n_vocab: int, data_bytes: int):
        self.max_tokens, self.n_vocab, self.data_bytes = max_tokens, n_vocab, data_bytes
        self.o_logits = round_up(4 * max_tokens, ALIGN)
        self.o_host = self.o_logits + round_up(4 * n_vocab, ALIGN)
        self.o_desc = self.o_host + 8 * HOST_MAX
        self.o_data = self.o_desc + 32 * MAX_TENSORS
        super().__init__(arena, ENTRY, round_up(self.o_data + data_bytes + ALIGN * MAX_TENSORS),
                         ("snapshots", geometry, max_tokens, n_vocab, data_bytes))
        self.refused = 0                # snapshots larger than a slot (not written)

    def _layout(self, shapes: list[tuple[int, int, int]]) -> list[int]:
        """Byte offsets in the slot of tensors (rows, cols, element bytes), in order."""
        offs, o = [], self.o_data
        for r, c, e in shapes:
            offs.append(o)
            o = round_up(o + r * c * e, ALIGN)
        return offs + [o]

    def find(self, h: bytes, toks) -> int | None:
        """The entry under chained hash h whose tokens are `toks` (a hash collision never matches), marked used."""
        slot = self.index.get(h)
        if slot is None:
            return None
        n = int(self.ent["n_tok"][slot])
        raw = self._raw(slot)
        if n != len(toks) or not np.array_equal(raw[:4 * n].view(torch.int32).numpy(), np.asarray(toks)):
            return None
        self._touch(slot)
        return slot

    def put(self, h: bytes, toks, snap: StateSnapshot, logits: torch.Tensor | None) -> bool:
        """Copy a snapshot after len(toks) tokens (and a whole prompt's logits [n_vocab]) in under h. An entry
        already there is only marked used. False: it does not fit a slot, or every slot is pinned."""
        if h in self.index:
            self._touch(self.index[h])
            return True
        ts = [(l, t) for l, layer in enumerate(snap.layers) for t in layer]
        host = None if snap.host is None else np.asarray(snap.host, dtype=np.int64)
        shapes = [(t.shape[0], t.shape[1], t.element_size()) for _, t in ts]
        offs = self._layout(shapes)
        if (len(toks) > self.max_tokens or len(ts) > MAX_TENSORS or offs[-1] > self.slot_bytes
                or (host is not None and host.size > HOST_MAX) or any(t.dim() != 2 for _, t in ts)):
            self.refused += 1
            return False
        slot = self._begin_write(h)
        if slot is None:
            return False
        raw = self._raw(slot)
        raw[:4 * len(toks)].view(torch.int32).copy_(torch.as_tensor(np.asarray(toks, dtype=np.int32)))
        if logits is not None:
            raw[self.o_logits:self.o_logits + 4 * self.n_vocab].view(torch.float32).copy_(logits.reshape(-1))
        if host is not None:
            raw[self.o_host:self.o_host + 8 * host.size].view(torch.int64).copy_(torch.from_numpy(host))
        desc = raw[self.o_desc:self.o_desc + 32 * len(ts)].view(torch.int64).view(len(ts), 4)
        for i, ((l, t), o) in enumerate(zip(ts, offs)):
            desc[i] = torch.tensor([l, t.shape[0], t.shape[1], DTYPES.index(t.dtype)])
            raw[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)    # D2H, synchronous
        e = self.ent
        e["whole"][slot], e["n_ten"][slot] = int(logits is not None), len(ts)
        e["n_host"][slot] = -1 if host is None else host.size
        self._end_write(slot, h, len(toks))
        return True

    def get(self, slot: int, device) -> tuple[StateSnapshot, torch.Tensor | None]:
        """The entry's StateSnapshot on `device` (H2D copies) and its logits [n_vocab] float32 (None: a checkpoint)."""
        e, raw = self.ent[slot], self._raw(slot)
        n_ten, n_host = int(e["n_ten"]), int(e["n_host"])
        desc = raw[self.o_desc:self.o_desc + 32 * n_ten].view(torch.int64).view(n_ten, 4).tolist()
        offs = self._layout([(r, c, DTYPES[d].itemsize) for _, r, c, d in desc])
        layers: list[list[torch.Tensor]] = []
        for (l, r, c, d), o in zip(desc, offs):
            dt = DTYPES[d]
            if l == len(layers):
                layers.append([])
            layers[l].append(raw[o:o + r * c * dt.itemsize].view(dt).view(r, c).to(device, copy=True))
        host = None if n_host < 0 else raw[self.o_host:self.o_host + 8 * n_host].view(torch.int64).numpy().copy()
        logits = (raw[self.o_logits:self.o_logits + 4 * self.n_vocab].view(torch.float32).to(device, copy=True)
                  if e["whole"] else None)
        self.hits += 1
        return StateSnapshot(int(e["n_tok"]), [tuple(ts) for ts in layers], host), logits
