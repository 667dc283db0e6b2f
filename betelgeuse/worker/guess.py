"""Speculative expert reads in decode: layer l+1's experts guessed at layer l, their disk reads started early.

Without it a decode step reads its few disk experts one layer at a time: layer l+1's reads start only after layer
l's experts ran and l+1's attention and routing did, so the disk waits for the GPU and the GPU for the disk. At
layer l the residual after l's attention exists already; layer l+1's own MoE input and router applied to it (the
model's functions, through the model interface and without the runner's routing hooks) guess l+1's choice, as
mixtral-offloading's speculative expert loading does (arXiv 2312.17238 §3.2: the next layer's gate on the current
hidden state). Why after l's attention and not after l's MoE: the MoE output is ready only once l's experts have
landed, too late to hide anything but l+1's attention, and its guess would need a host sync of its own; the
residual after attention is ready before l's routing sync, so the guess rides to the host on that sync (one
transfer: l's row counts and the guess's expert marks together) and its reads overlap l's experts and l+1's
attention. The residual stream changes little from one layer to the next in a trained model, which is what makes
the guess good; hash-routed layers (deepseek4) route by token id, so their guess is exact.

The guessed experts that sit on disk are read ahead through the store's prefetch (at read-ahead priority, in at most
half the staging slots), after layer l's own demand reads have started, and without waiting for the store's answer
(read when layer l+1 is scored: a round trip per layer would cost about what a guess saves). Only WHEN bytes
arrive changes: a guess is never used to compute (layer l+1 routes itself as always), so outputs are the same bits
with it on or off (invariant 1).

Counted per pass (PassStats): guessed (guessed experts on disk), guess_hits (those the layer then used), guess_disk
(the disk experts of guessed layers), guess_bytes (reads started for guesses), guess_wasted_bytes (those reads that
no demand load of their layer took: about, as a read ahead may still serve a later token from its staged copy).
"""

from __future__ import annotations

import numpy as np
import torch

from betelgeuse.store.directory import TIER_DISK
from betelgeuse.worker.stats import PassStats


def guess_next(model, layer: int, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """x: the residual after layer `layer`'s attention (the model's form: [T,H], deepseek4 [T,hc,H]), token_ids [T]
    -> layer+1's guessed expert ids [T, k] int64 on the device (no sync). The model's own routing of layer+1 on
    that residual (unhooked: a routing recorder or replayer sees only the real routing)."""
    h, _ = model.moe_input(layer + 1, x)
    return type(model).route(model, layer + 1, h, token_ids, None)[0]


class Guesser:
    """The host side of one attachment's guesses: the guessed ids to the host with a layer's row counts, the reads
    ahead, and the counts of hits and waste (module doc)."""

    __slots__ = ("session", "expert_bytes", "_open")

    def __init__(self, session, n_layer: int):
        self.session = session
        self.expert_bytes = [session.file.expert_nbytes(l) for l in range(n_layer)]   # one expert's disk bytes
        self._open: dict = {}               # guessed layer -> (pass stats, guessed disk experts, reads started)

    @staticmethod
    def to_host(counts: torch.Tensor, guess: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray | None]:
        """A layer's rows per expert [E] (device) and the next layer's guess [T, k] (or None) -> on the host in ONE
        transfer: (counts [E], guessed marks [E] or None). This is the layer's routing sync; the guess adds none."""
        if guess is None:
            return counts.cpu().numpy(), None
        E = counts.numel()
        marks = torch.zeros(E, dtype=counts.dtype, device=counts.device).index_fill_(0, guess.reshape(-1), 1)
        both = torch.cat([counts, marks]).cpu().numpy()
        return both[:E], both[E:]

    def read_ahead(self, layer: int, marks: np.ndarray, snap, stats: PassStats):
        """Start the reads of layer `layer`'s guessed experts that sit on disk (store prefetch)."""
        e = np.nonzero(marks)[0]
        disk = e[snap["tier"][layer][e] == TIER_DISK]
        if len(disk):
            # not waited for: the store's answer (reads started) is read when the layer is scored
            self._open[layer] = (stats, disk, self.session.prefetch_start([(layer, int(x)) for x in disk]))

    def check(self, layer: int, disk: np.ndarray, ahead_used: int, stats: PassStats):
        """Layer `layer` ran with these disk experts, `ahead_used` of them answered from reads ahead: score the guess
        made for it in this pass, if any."""
        o = self._open.pop(layer, None)
        if o is None or o[0] is not stats:
            return
        _, guessed, answer = o
        queued = answer()
        stats.guessed += len(guessed)
        stats.prefetched += queued
        stats.guess_bytes += queued * self.expert_bytes[layer]
        stats.guess_hits += int(np.intersect1d(guessed, disk).size)
        stats.guess_disk += len(disk)
        stats.guess_wasted_bytes += max(0, queued - ahead_used) * self.expert_bytes[layer]
