"""The residency policy: which experts the resident tiers should hold, as moves from the current placement.

A pure function of arrays (no threads, no arena): the store (store/store.py) calls it under its lock when a pass
ends with consolidation, then vacates, fills and commits the moves (invariant 5: the directory changes only between
passes). Rank per layer: decayed usage score descending, currently resident first, expert id ascending (stable and
deterministic); the top n_vram + n_host are resident. A resident expert ranks by HOST_STICKY x its score +
HOST_MARGIN (hysteresis): an expert on disk takes a full tier's place only when it beats the weakest resident by that
much, so two experts of about the same use do not trade places (each trade is a disk read, and the vacated expert is
read from disk by the passes while the slot fills). `max_new` bounds the experts newly resident per consolidation
(each one a disk read): the largest gains (score over the ranking score of the resident it displaces) first, the
rest wait for a later consolidation (with engine.fill_budget on, the store sets it from what the disk can deliver
before the next one: fill_budget).
With VRAM backing copies the top n_vram of them go to VRAM,
the rest to the host tier. Without copies a swap between the tiers costs disk reads (a VRAM expert demoted to the host
tier has no copy in RAM, so the store reads it again), so VRAM membership is sticky: within the resident set a VRAM
expert's score counts VRAM_STICKY times when ranking for VRAM (a host expert replaces it only when used that much more).
Experts never used keep their place: this is physical placement only, it never changes a result (invariant 1).
"""

from __future__ import annotations

import numpy as np

from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM
from betelgeuse.store.plan import SlotPlan

Move = tuple[int, int, int, int]        # (layer, expert, new tier, host slot or -1)
# without backing copies: a VRAM expert keeps its VRAM slot against host experts scored up to this factor higher (a swap
# reads the demoted expert from disk; the host tier's H2D copy of the other costs ~1/30 of that on the benchmark's H200)
VRAM_STICKY = 2.0
# a resident expert ranks at HOST_STICKY x score + HOST_MARGIN (scores count routed rows, halved each consolidation):
# on the CPU churn workloads (tests/scripts/placement_churn.py) 1.25 and 2 cut the moves of steady batched decode ~6x
# and its demand reads a little; larger factors kept stale experts in a conversation's later turns (more demand reads)
HOST_STICKY = 1.25
HOST_MARGIN = 2.0


def fill_budget(rate: float, interval_s: float, demand_bytes: int, expert_bytes: int, floor: int) -> int | None:
    """max_new for the next consolidation: the experts the disk can read before the one after it, at `rate` bytes/s
    (what it delivered while busy) over `interval_s` (the last interval between consolidations), less the
    `demand_bytes` the passes read in that interval (they go first: fills read at read-ahead priority); at least
    `floor` (placement always progresses). None (no bound) while the rate or the interval is unknown."""
    if rate <= 0 or interval_s <= 0:
        return None
    return max(floor, int((rate * interval_s - demand_bytes) // max(1, expert_bytes)))


def _rank_key(score: float, tier: int, hysteresis: bool = True) -> float:
    """The score a layer's experts are ranked by for residency (higher first): hysteresis for the resident ones."""
    return score * HOST_STICKY + HOST_MARGIN if hysteresis and tier != TIER_DISK else score


def resident_sets(score: np.ndarray, tiers: np.ndarray, plan: SlotPlan, max_new: int | None = None,
                  hysteresis: bool = True) -> list[list[int]]:
    """The experts each layer should hold resident (n_vram + n_host at most), in rank order: the ranking (module doc;
    hysteresis=False: by score alone), then at most `max_new` experts newly resident over all layers (None: no
    bound), the largest gains first."""
    p = plan
    n_res = p.n_vram + p.n_host
    orders, tops, gains = [], [], []      # gains: (gain, layer, kept newcomers in that layer after this one)
    for l in range(p.n_layer):
        cur = tiers[l]
        # rank: hysteresis score desc, currently resident first, expert id asc (stable and deterministic). One
        # lexsort over the layer (last key first), the order a Python sort on that key tuple gives: the same float
        # arithmetic as _rank_key, ties broken to the expert id (the store runs this inside EndPass: issue 21)
        rk = np.where(cur != TIER_DISK, score[l] * HOST_STICKY + HOST_MARGIN, score[l]) if hysteresis else score[l]
        order = np.lexsort((np.arange(p.n_expert), -(cur > 0).astype(np.int64), -rk)).tolist()
        orders.append(order)
        tops.append(order[:n_res])
        new = [e for e in tops[l] if cur[e] == TIER_DISK and score[l, e] > 0]    # rank order: best first
        out = [e for e in order[n_res:] if cur[e] != TIER_DISK]                   # pushed out: strongest first
        free = len(new) - len(out)        # slots no resident gives up (a tier not yet full)
        for i, e in enumerate(new):       # keeping newcomers 0..i: the i-th fills a free slot or displaces the
            rival = out[len(out) - 1 - (i - free)] if i >= free else None     # weakest leaver still kept
            g = score[l, e] - (_rank_key(score[l, rival], cur[rival], hysteresis) if rival is not None else 0.0)
            gains.append((g, l, i + 1))
    if max_new is None or len(gains) <= max_new:
        return tops
    kept = [0] * p.n_layer                # newcomers kept per layer: a prefix of each layer's (gains fall within one)
    for g, l, n in sorted(gains, key=lambda x: (-x[0], x[1], x[2]))[:max(0, max_new)]:
        kept[l] = max(kept[l], n)
    out_sets = []
    for l in range(p.n_layer):
        cur, order, top = tiers[l], orders[l], tops[l]
        new = [e for e in top if cur[e] == TIER_DISK and score[l, e] > 0]
        out = [e for e in order[n_res:] if cur[e] != TIER_DISK]
        free = len(new) - len(out)
        stay = out[:len(out) - max(0, kept[l] - free)]          # the leavers no kept newcomer displaces
        dropped = set(new[kept[l]:])
        pos = {e: i for i, e in enumerate(order)}
        out_sets.append(sorted([e for e in top if e not in dropped] + stay, key=pos.__getitem__))
    return out_sets


def plan_moves(score: np.ndarray, tiers: np.ndarray, host_owner: np.ndarray, plan: SlotPlan,
               max_new: int | None = None, hysteresis: bool = True) -> list[Move]:
    """score [n_layer, n_expert] float (decayed usage), tiers [n_layer, n_expert] (the directory's current TIER_*),
    host_owner [n_layer, host_per_layer] (the expert in each host slot, -1 free), max_new and hysteresis
    (resident_sets) -> the moves
    that place each layer's resident set: its first n_vram in VRAM, the rest in host slots."""
    p = plan
    moves: list[Move] = []
    for l, top in enumerate(resident_sets(score, tiers, plan, max_new, hysteresis)):
        # Python lists and a dict of the host slots: per-expert numpy scalar reads and `owner == e` scans were ~6 ms
        # of EndPass at ds4-flash's shapes (8 layers x 256 experts), the worker waiting for its reply (issue 21)
        cur_tier, sc = tiers[l].tolist(), score[l].tolist()
        if not p.vram_backing:           # VRAM membership within the resident set is sticky (module doc)
            top = sorted(top, key=lambda e: (-sc[e] * (VRAM_STICKY if cur_tier[e] == TIER_VRAM else 1.0),
                                              -int(cur_tier[e] == TIER_VRAM), -int(cur_tier[e] > 0), e))
        want = {}
        for rank, e in enumerate(top):
            if sc[e] <= 0 and cur_tier[e] == TIER_DISK:
                continue
            want[e] = TIER_VRAM if rank < p.n_vram else TIER_HOST
        owner = host_owner[l].tolist()
        slot_of: dict[int, int] = {}     # expert -> its first host slot (`np.nonzero(owner == e)[0][0]`)
        for i, e in enumerate(owner):
            if e >= 0:
                slot_of.setdefault(e, i)

        def needs_slot(e):       # host tier, or a VRAM expert with a backing copy
            return e in want and (want[e] == TIER_HOST or p.vram_backing)

        # promoted to VRAM without backing: keeps its host slot for one round, so the worker copies it from RAM,
        # not disk; but only while the host tier's own experts still get slots (experts demoted from VRAM need
        # new ones): the lowest-ranked transits give theirs up first (the worker then reads those from disk)
        transit = [e for e in want if not p.vram_backing and want[e] == TIER_VRAM
                   and cur_tier[e] != TIER_VRAM and e in slot_of]
        need = sum(1 for e in want if needs_slot(e) and e not in slot_of)
        n_free = sum(1 for e in owner if e < 0 or (not needs_slot(e) and e not in transit))
        transit = set(transit[:max(0, len(transit) - max(0, need - n_free))])

        leaving = [i for i, e in enumerate(owner) if e >= 0 and not needs_slot(e) and e not in transit]
        free = [i for i, e in enumerate(owner) if e < 0] + leaving
        for i in leaving:
            if owner[i] not in want:
                moves.append((l, owner[i], TIER_DISK, -1))
        for e in range(len(cur_tier)):   # VRAM without a host slot, no longer wanted
            if cur_tier[e] == TIER_VRAM and e not in want and e not in slot_of:
                moves.append((l, e, TIER_DISK, -1))
        to_vram = []                               # disk-tier experts promoted to VRAM without backing
        for e, tier in want.items():
            held = slot_of.get(e)                  # its host slot, None: none
            if e in transit:                       # VRAM now, its host slot freed at the next consolidation
                moves.append((l, e, tier, held))
            elif not needs_slot(e) and cur_tier[e] == TIER_DISK and held is None:
                to_vram.append(e)
            elif not needs_slot(e):                # VRAM without a backing copy (the worker holds the bytes)
                if cur_tier[e] != tier or held is not None:
                    moves.append((l, e, tier, -1))
            elif held is None:
                moves.append((l, e, tier, free.pop(0)))
            elif cur_tier[e] != tier:
                moves.append((l, e, tier, held))
        # host slots nobody else needs carry disk -> VRAM promotions for one round (filled from the staged copy
        # when there is one), so the worker fills its VRAM slot from RAM instead of reading the disk again
        for e in to_vram:
            moves.append((l, e, TIER_VRAM, free.pop(0) if free else -1))
    return moves
