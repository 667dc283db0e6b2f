"""The event log of copy ahead in pool-routed decode (issue 21, MoEStep._ahead_start / _ahead_group), shared by
tests/worker/test_decode_copy_ahead.py and docs/benchmarks/cpu-pool48/copy_ahead.py: watch() wraps a runner's
expert step, ring copies and applies to record the step's events in order; ahead_reads() counts the routed host
experts computed from a copy made before their layer's routing reached the host."""

from __future__ import annotations

import numpy as np

from betelgeuse.store.directory import TIER_HOST


def watch(rn, log: list):
    """Record, in order: ("route", l, host experts routed) at the entry of layer l's host step (before its sync:
    its routing is not known on the host yet), ("copy", (layer, expert), pool offset) for every host slot copied into
    the ring, ("apply", l, {expert: pool offset}) for every group computed from the pool."""
    moe, cache = rn.moe, rn.cache
    snap = rn.session.directory.snapshot()
    lay = cache.layout
    slot_of = {}                                    # a host slot's arena offset -> (layer, expert)
    for l, e in zip(*np.nonzero(snap["tier"] == TIER_HOST)):
        slot_of[lay.host_slot_offset(int(l), int(snap["host_slot"][l, e]))] = (int(l), int(e))
    base = cache.host.data_ptr()
    partial, bank_copy, apply = moe._partial, cache.bank_copy, moe.kern.apply

    def partial_logged(l, r, *a, **kw):
        tiers = snap["tier"][l]
        log.append(("route", l, {int(e) for e in np.nonzero(r.counts.cpu().numpy())[0] if tiers[e] == TIER_HOST}))
        return partial(l, r, *a, **kw)

    def copy_logged(b, at, srcs, *a, **kw):
        offs = bank_copy(b, at, srcs, *a, **kw)
        for s, o in zip(srcs, offs):
            key = slot_of.get(s.data_ptr() - base)
            if key is not None:
                log.append(("copy", key, o))
        return offs

    def apply_logged(r, layer, pool, g, *a, **kw):
        if pool is cache.pool and g.base_host is not None:
            log.append(("apply", layer, {int(e): int(g.base_host[e]) for e in np.nonzero(g.base_host != -1)[0]}))
        return apply(r, layer, pool, g, *a, **kw)
    moe._partial, cache.bank_copy, moe.kern.apply = partial_logged, copy_logged, apply_logged


def ahead_reads(log: list) -> int:
    """Host experts that a layer routed to and computed from a ring slot copied BEFORE that layer's routing reached
    the host (in the same step), at the offset that copy wrote."""
    n, copied, routed = 0, {}, None
    for ev in log:
        if ev[0] == "step":
            copied, routed = {}, None
        elif ev[0] == "route":
            l, hosts = ev[1], ev[2]
            routed = (l, {e: copied[l, e] for e in hosts if (l, e) in copied})      # copied before the routing
        elif ev[0] == "copy":
            copied[ev[1]] = ev[2]
        elif ev[0] == "apply" and routed is not None and ev[1] == routed[0]:
            for e, off in ev[2].items():
                if routed[1].get(e) == off:
                    n += 1
                    del routed[1][e]
    return n
