"""The residency policy (store/residency.py plan_moves) alone: no store, no threads, no arena.

The expected placement is worked out here from the policy's statement (top n_vram experts of a layer by decayed
score in VRAM, the next n_host in host slots; ties: currently resident first, then the lower id; never-used experts
keep their place), and a placement is evolved over many consolidation rounds with the store's vacate-then-commit
steps, checking after each round that every slot has one holder and every tier its size.
"""

import numpy as np
import pytest

from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM
from betelgeuse.store.plan import SlotPlan
from betelgeuse.store.residency import HOST_MARGIN, HOST_STICKY, VRAM_STICKY, fill_budget, plan_moves


def _plan(n_layer, n_expert, n_vram, n_host, backing=True) -> SlotPlan:
    return SlotPlan("m.gguf", n_layer, n_expert, n_vram, n_host, 4, (4096, 4096, 4096), 0, 0, None, [], backing)


class Placement:
    """tiers [L, E], host_slot [L, E] and host_owner [L, slots], changed as the store changes them."""

    def __init__(self, plan: SlotPlan):
        L, E = plan.n_layer, plan.n_expert
        self.plan = plan
        self.tier = np.full((L, E), TIER_DISK, dtype=np.int64)
        self.slot = np.full((L, E), -1, dtype=np.int64)
        self.owner = np.full((L, plan.host_per_layer), -1, dtype=np.int64)

    def apply(self, moves):
        for l, e, _, slot in moves:            # vacate: a slot changing hands leaves its owner first
            if slot >= 0 and self.owner[l, slot] not in (-1, e):
                o = self.owner[l, slot]
                self.tier[l, o] = TIER_VRAM if self.tier[l, o] == TIER_VRAM else TIER_DISK
                self.slot[l, o] = -1
                self.owner[l, slot] = -1
        for l, e, tier, slot in moves:         # commit: slots given up first, then taken
            self.owner[l][self.owner[l] == e] = -1
            if slot < 0:
                self.tier[l, e], self.slot[l, e] = tier, -1
        for l, e, tier, slot in moves:
            if slot >= 0:
                self.owner[l, slot] = e
                self.tier[l, e], self.slot[l, e] = tier, slot

    def check(self):
        p = self.plan
        for l in range(p.n_layer):
            assert (self.tier[l] == TIER_VRAM).sum() <= p.n_vram
            assert (self.tier[l] == TIER_HOST).sum() <= p.n_host
            for e in range(p.n_expert):
                s = self.slot[l, e]
                assert (self.tier[l, e] == TIER_HOST) <= (s >= 0), (l, e)      # a host expert has its slot
                assert self.tier[l, e] != TIER_DISK or s < 0, (l, e)
                if s >= 0:
                    assert self.owner[l, s] == e, (l, e, s)                    # one holder per slot
            held = self.owner[l][self.owner[l] >= 0]
            assert len(set(held.tolist())) == len(held)
            if p.vram_backing:                                                 # every VRAM expert keeps a copy
                assert all(self.slot[l, e] >= 0 for e in np.nonzero(self.tier[l] == TIER_VRAM)[0])


def test_fresh_placement_is_the_top_of_the_ranking():
    p = _plan(1, 8, 2, 3)
    score = np.array([[0, 5, 1, 9, 0, 3, 3, 0]], dtype=np.float64)
    pl = Placement(p)
    pl.apply(plan_moves(score, pl.tier, pl.owner, p))
    pl.check()
    # rank: 3 (9), 1 (5), 5 and 6 (3: the lower id first), 2 (1); unused 0, 4, 7 stay on disk
    assert set(np.nonzero(pl.tier[0] == TIER_VRAM)[0]) == {3, 1}
    assert set(np.nonzero(pl.tier[0] == TIER_HOST)[0]) == {5, 6, 2}
    assert all(pl.tier[0, e] == TIER_DISK for e in (0, 4, 7))


def test_ties_keep_resident_experts_and_unused_ones_keep_their_place():
    p = _plan(1, 6, 1, 1)
    pl = Placement(p)
    pl.apply(plan_moves(np.array([[0, 0, 0, 0, 2, 1]], float), pl.tier, pl.owner, p))
    assert pl.tier[0, 4] == TIER_VRAM and pl.tier[0, 5] == TIER_HOST
    # now every score is equal: the resident experts win the ties (not the lower ids 0..3), so nothing moves
    assert plan_moves(np.ones((1, 6)), pl.tier, pl.owner, p) == []
    # a demoted VRAM expert with a backing copy keeps its host slot (a tier change, no copy)
    slot4 = pl.slot[0, 4]
    moves = plan_moves(np.array([[0, 0, 0, 0, 1, 3]], float), pl.tier, pl.owner, p)
    assert (0, 4, TIER_HOST, slot4) in moves
    pl.apply(moves)
    pl.check()
    assert pl.tier[0, 5] == TIER_VRAM and pl.tier[0, 4] == TIER_HOST


def test_without_backing_copies_a_promoted_expert_keeps_its_host_slot_one_round():
    p = _plan(1, 6, 1, 3, backing=False)
    pl = Placement(p)
    pl.apply(plan_moves(np.array([[0, 0, 0, 3, 2, 1]], float), pl.tier, pl.owner, p))
    pl.check()
    assert pl.tier[0, 3] == TIER_VRAM and pl.slot[0, 3] >= 0        # disk -> VRAM: carried by the free host slot
    assert (pl.tier[0] == TIER_HOST).sum() == 2
    # expert 4 (host) is promoted: it keeps its slot this round (the worker copies it from RAM)
    slot4 = pl.slot[0, 4]
    moves = plan_moves(np.array([[0, 0, 0, 0, 9, 1]], float), pl.tier, pl.owner, p)
    assert (0, 4, TIER_VRAM, slot4) in moves
    pl.apply(moves)
    pl.check()
    # the next round gives the transit slot up: expert 4 stays in VRAM without a host slot
    pl.apply(plan_moves(np.array([[0, 0, 0, 0, 9, 1]], float), pl.tier, pl.owner, p))
    pl.check()
    assert pl.tier[0, 4] == TIER_VRAM and pl.slot[0, 4] == -1


@pytest.mark.parametrize("backing", [True, False])
def test_rounds_of_shifting_usage_keep_the_invariants_and_reach_the_ranking(backing):
    p = _plan(3, 16, 3, 5, backing)
    rng = np.random.default_rng(7)
    pl = Placement(p)
    score = np.zeros((3, 16))
    for _ in range(40):
        hot = rng.choice(16, size=6, replace=False)
        usage = np.zeros((3, 16))
        usage[:, hot] = rng.integers(1, 20, size=(3, 6))
        score = 0.5 * score + usage
        before = pl.tier.copy()
        pl.apply(plan_moves(score, pl.tier, pl.owner, p))
        pl.check()
        for l in range(3):
            # the ranking: by score, a resident one (before this round) by HOST_STICKY x score + HOST_MARGIN
            key = [score[l, e] * HOST_STICKY + HOST_MARGIN if before[l, e] != TIER_DISK else score[l, e]
                   for e in range(16)]
            vram, host = np.nonzero(pl.tier[l] == TIER_VRAM)[0], np.nonzero(pl.tier[l] == TIER_HOST)[0]
            resident = set(vram) | set(host)
            used_out = [e for e in range(16) if score[l, e] > 0 and e not in resident]
            if len(resident) < p.n_vram + p.n_host:
                assert not used_out, (l, used_out)            # a tier not full takes every used expert
            else:                                             # none left out ranks above one kept
                assert all(key[d] <= key[r] for d in used_out for r in resident), (l, used_out, resident)
            if backing:
                assert all(key[v] >= key[h] for v in vram for h in host), (l, vram, host)
            elif len(resident) >= p.n_vram:   # in VRAM, no expert a host one outscores VRAM_STICKY times
                assert len(vram) == p.n_vram
                assert all(VRAM_STICKY * score[l, v] >= score[l, h] for v in vram for h in host), (l, vram, host)


def test_a_disk_expert_displaces_a_resident_one_only_past_the_hysteresis():
    """Expert 0 resident (score s), 1 on disk, one resident slot: 1 takes the slot only when its score beats
    HOST_STICKY x s + HOST_MARGIN; without hysteresis (the policy before it) as soon as it scores higher, so two
    experts of about the same use traded the slot (a disk read) at every consolidation."""
    p = _plan(1, 2, 0, 1, backing=True)
    pl = Placement(p)
    pl.apply(plan_moves(np.array([[4.0, 0.0]]), pl.tier, pl.owner, p))
    assert (pl.tier[0, 0], pl.tier[0, 1]) == (TIER_HOST, TIER_DISK)
    edge = 4.0 * HOST_STICKY + HOST_MARGIN
    assert plan_moves(np.array([[4.0, 0.99 * edge]]), pl.tier, pl.owner, p) == []
    assert plan_moves(np.array([[4.0, 4.5]]), pl.tier, pl.owner, p) == []
    assert len(plan_moves(np.array([[4.0, 4.5]]), pl.tier, pl.owner, p, hysteresis=False)) == 2    # the trade
    pl.apply(plan_moves(np.array([[4.0, 1.01 * edge]]), pl.tier, pl.owner, p))
    pl.check()
    assert (pl.tier[0, 0], pl.tier[0, 1]) == (TIER_DISK, TIER_HOST)


def test_max_new_keeps_the_largest_gains_and_the_displaced_residents():
    """Two layers, 2 resident slots each (no VRAM). Layer 0 holds experts 0, 1; layer 1 holds 0 and has a free slot.
    New scores want 2 and 3 resident in layer 0 (gains over the residents they displace: 30 - (1 x sticky + margin)
    and 20 - ...), and 2 in layer 1's free slot (gain 25). max_new = 2 keeps the two largest gains: layer 0's 2
    (displacing the weaker resident, 1) and layer 1's 2; layer 0's 3 waits and expert 0 stays."""
    p = _plan(2, 4, 0, 2, backing=True)
    pl = Placement(p)
    pl.apply(plan_moves(np.array([[2.0, 1.0, 0, 0], [2.0, 0, 0, 0]]), pl.tier, pl.owner, p))
    assert set(np.nonzero(pl.tier[0] == TIER_HOST)[0]) == {0, 1} and set(np.nonzero(pl.tier[1] == TIER_HOST)[0]) == {0}
    score = np.array([[2.0, 1.0, 30.0, 20.0], [2.0, 0, 25.0, 0]])
    assert len(plan_moves(score, pl.tier, pl.owner, p, max_new=None)) == 5     # 2 in, 2 out in layer 0; 1 in
    moves = plan_moves(score, pl.tier, pl.owner, p, max_new=2)
    pl.apply(moves)
    pl.check()
    assert set(np.nonzero(pl.tier[0] == TIER_HOST)[0]) == {0, 2}
    assert set(np.nonzero(pl.tier[1] == TIER_HOST)[0]) == {0, 2}
    assert len(moves) == 3
    # the next consolidation (unbounded) brings 3 in
    pl.apply(plan_moves(score, pl.tier, pl.owner, p))
    assert set(np.nonzero(pl.tier[0] == TIER_HOST)[0]) == {2, 3}


@pytest.mark.parametrize("backing", [True, False])
def test_without_backing_copies_vram_membership_is_sticky(backing):
    """Expert 0 in VRAM, 1 in the host tier (every expert resident). Without copies a swap reads the demoted expert
    from disk, so 1 takes 0's VRAM slot only when scored more than VRAM_STICKY times higher; with copies at once."""
    p = _plan(1, 2, 1, 1, backing=backing)
    pl = Placement(p)
    pl.apply(plan_moves(np.array([[2.0, 1.0]]), pl.tier, pl.owner, p))
    assert (pl.tier[0, 0], pl.tier[0, 1]) == (TIER_VRAM, TIER_HOST)
    pl.apply(plan_moves(np.array([[1.0, 0.9 * VRAM_STICKY]]), pl.tier, pl.owner, p))
    pl.check()
    assert (pl.tier[0, 0], pl.tier[0, 1]) == ((TIER_HOST, TIER_VRAM) if backing else (TIER_VRAM, TIER_HOST))
    pl.apply(plan_moves(np.array([[1.0, 1.1 * VRAM_STICKY]]), pl.tier, pl.owner, p))
    pl.check()
    assert (pl.tier[0, 0], pl.tier[0, 1]) == (TIER_HOST, TIER_VRAM)


def test_fill_budget_is_what_the_disk_reads_before_the_next_consolidation():
    # 1 GB/s over 2 s, 1.5 GB of it demand reads: 0.5 GB of 10 MB experts = 50; never under the floor; unknown: None
    assert fill_budget(1e9, 2.0, int(1.5e9), 10_000_000, 4) == 50
    assert fill_budget(1e9, 2.0, int(2.5e9), 10_000_000, 4) == 4
    assert fill_budget(0.0, 2.0, 0, 10_000_000, 4) is None and fill_budget(1e9, 0.0, 0, 10_000_000, 4) is None
