"""cpu-spike56: residency.py (this checkout) against an older copy (argv[1]: `git show
main:betelgeuse/store/residency.py > /tmp/old.py`) on random placements: the same moves and resident sets, or the same
IndexError on an infeasible one; then plan_moves timed at ds4-flash's shape (8 x 256, 49 + 77 slots) on both."""
import sys, types, time, importlib.util
import numpy as np
from betelgeuse.store import residency as N
from betelgeuse.store.directory import TIER_VRAM, TIER_HOST, TIER_DISK
spec = importlib.util.spec_from_file_location("old_res", sys.argv[1])
O = importlib.util.module_from_spec(spec)
spec.loader.exec_module(O)
rng = np.random.default_rng(1)
n = 0
bad = [0]
for trial in range(3000):
    L, E = int(rng.integers(1, 4)), int(rng.integers(4, 40))
    nv, nh = int(rng.integers(0, E // 2)), int(rng.integers(0, E // 2))
    backing = bool(rng.integers(2))
    p = types.SimpleNamespace(n_layer=L, n_expert=E, n_vram=nv, n_host=nh, vram_backing=backing, host_per_layer=nh)
    tiers = np.zeros((L, E), np.int64); owner = np.full((L, nh), -1, np.int64)
    for l in range(L):
        perm = rng.permutation(E)
        k = int(rng.integers(0, nv + 1)); tiers[l, perm[:k]] = TIER_VRAM
        h = int(rng.integers(0, nh + 1)); tiers[l, perm[k:k + h]] = TIER_HOST
        slots = rng.permutation(nh)[:h]; owner[l, slots] = perm[k:k + h]
        if backing:      # some VRAM experts hold a backing slot
            fr = [i for i in range(nh) if owner[l, i] < 0]
            for i, e in zip(fr, perm[:k]):
                if rng.random() < 0.5: owner[l, i] = e
        else:            # transit: VRAM experts still holding a host slot
            fr = [i for i in range(nh) if owner[l, i] < 0]
            for i, e in zip(fr, perm[:k]):
                if rng.random() < 0.3: owner[l, i] = e
    score = np.round(rng.gamma(0.5, 4, (L, E)), int(rng.integers(0, 3))) * (rng.random((L, E)) < 0.7)
    for mn in (None, int(rng.integers(0, 6))):
        for hy in (True, False):
            def run(M):
                try: return M.plan_moves(score, tiers, owner, p, mn, hy)
                except IndexError: return "IndexError"
            a, b = run(O), run(N)
            assert a == b, (trial, a, b)
            if a == "IndexError": bad[0] += 1; continue
            assert all(type(x) is int for m in b for x in m), b
            assert O.resident_sets(score, tiers, p, mn, hy) == N.resident_sets(score, tiers, p, mn, hy)
            n += 1
print("equal on", n, "cases, infeasible (both IndexError)", bad[0])
L, E, nv, nh = 8, 256, 49, 77
p = types.SimpleNamespace(n_layer=L, n_expert=E, n_vram=nv, n_host=nh, vram_backing=False, host_per_layer=nh)
tiers = np.zeros((L, E), np.int64); owner = np.full((L, nh), -1, np.int64)
for l in range(L):
    perm = rng.permutation(E)
    tiers[l, perm[:nv]] = TIER_VRAM; tiers[l, perm[nv:nv + nh]] = TIER_HOST; owner[l] = perm[nv:nv + nh]
score = rng.gamma(0.5, 10, (L, E)) * (rng.random((L, E)) < 0.6)
for name, M in (("old", O), ("new", N)):
    ts = []
    for _ in range(20):
        t = time.perf_counter(); M.plan_moves(score, tiers, owner, p, None, True); ts.append(time.perf_counter() - t)
    print(name, "plan_moves ds4-flash shapes (8x256, 49+77, no backing): median ms", round(sorted(ts)[10] * 1e3, 3))
