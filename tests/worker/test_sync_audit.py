"""Exact decode's steps make the host wait for the GPU only where the pass clock counts it (issue 21, sync48).

deploy/device/sync_audit.py runs decode_host.py's decode (a real store process, ds4-tiny, the static form as CUDA
decodes, the flex cache capped so fills evict and the at-hand table is uploaded inside steps) on the CPU under a torch
function mode that records each op that WOULD block the host on CUDA (a copy into a device tensor from a host one
not meant to be pinned, a device tensor read on the host, an index by a host tensor, a data-dependent size, a pinned
allocation). The timed steps may hold such ops only inside the pass clock's waits (counted as blocked) or on the
paths only the CPU takes (CPU_ONLY, each argued). The checks fail on main before sync48: its at-hand upload copied
from pageable memory on the CPU path (on CUDA: a pinned block from the caching host allocator per upload).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "deploy" / "device"))
import sync_audit  # noqa: E402

# (file, function) of would-sync ops the timed steps may hold outside the counted waits, and why
CPU_ONLY = {
    # the torch ops' eager attention (deepseek4.TorchOps) reads the visible entries' count on the host and selects
    # the visible top rows by a mask (CUDA: triton_ds4.TritonOps' index_topk / decode_attend kernels)
    ("deepseek4.py", "_visible"),
    ("deepseek4.py", "decode_attend"),
    # the torch kernels' host plan (CUDA's at-hand path runs the triton kernels: MoEStep._hand_on)
    ("torch_moe.py", "plan_experts"),
    # the CPU drains a gated layer where its gate stands (CUDA: triton_gate's publish, the host polls pinned memory)
    ("gate.py", "publish_and_gate"),
    # NOT CPU-only: the step's token ids [T] uploaded at its start; the previous pass ended on its counted end sync,
    # so the GPU is idle and the host waits for its own few-byte copy (a few us a token, not an application)
    ("layers.py", "check_token_ids"),
}
ARGS = ["--preset", "ds4-tiny", "--vram", "2", "--host", "3", "--flex", "on", "--flex-slots", "3", "--tokens", "8",
        "--skip", "2"]


def _sites(d: dict) -> set:
    return {(k.split("@", 1)[1].split(":")[0], k.rsplit(":", 1)[1]) for k in d}


# solo; solo with the host experts banked (ds4-flash's MXFP4 under auto: they share the first disk group's bank,
# gpu-run48-ds4's path); the batched lanes gated
@pytest.mark.parametrize("form", [["--form", "solo"], ["--form", "solo", "--host-in-place", "never"],
                                  ["--form", "lanes", "--gate"]], ids=["solo", "solo-banked", "lanes-gate"])
def test_exact_decode_steps_hold_no_hidden_sync(form):
    res = sync_audit.run(ARGS + form)
    audit, med = res["sync_audit"], res["per_token_median"]
    assert med["miss_layers"] > 0, med                      # disk experts: the expert step's miss path ran
    if "--gate" not in form:
        # the step's start, and inside some (a flex eviction of a later layer's copy: AtHand.stale(after=l))
        assert med["mean_uploads"] > 1, med
        assert ("moe_step.py", "finish") in _sites(audit["counted"]), audit   # the routing sync, seen and counted
    hidden = _sites(audit["hidden"]) - CPU_ONLY
    assert not hidden, audit["hidden"]


def test_the_audit_sees_a_sync_added_to_the_expert_step(monkeypatch):
    """The check can fail: a host read of the routing's counts added before each layer's misses (as a debug line
    would) is reported outside the counted waits (at the innermost betelgeuse frame: the step's caller)."""
    from betelgeuse.worker.moe_step import MoEStep
    misses = MoEStep.hand_misses

    def hand_misses(self, l, r, *args, **kw):
        int(r.counts.sum())                                  # a D2H read: a stream sync on CUDA
        return misses(self, l, r, *args, **kw)
    monkeypatch.setattr(MoEStep, "hand_misses", hand_misses)
    res = sync_audit.run(ARGS + ["--form", "solo"])
    assert _sites(res["sync_audit"]["hidden"]) - CPU_ONLY, res["sync_audit"]


def test_the_shim_tells_device_tensors_and_pinned_sources():
    """The CPU's tags (sync_audit's module doc) against what CUDA does: a copy into a device tensor from pageable
    memory syncs, from a pinned-meant one (pin_memory= given) does not; a host index into a device tensor syncs."""
    audit = sync_audit.SyncAudit()
    with audit:
        dev = torch.zeros(4, device="cpu")                   # an explicit device: meant for the device
        page, pinned = torch.ones(4), torch.ones(4, pin_memory=False)
        audit.on = True
        dev.copy_(pinned, non_blocking=True)
        dev[1:].copy_(pinned[1:], non_blocking=True)         # views keep both tags
        n_quiet = len(audit.hidden)
        dev.copy_(page)
        dev[torch.tensor([0, 2])] = 1.0
        (dev + 1)[0].item()
        dev[dev > 0]                                         # a device mask: a data-dependent size
        page.sum().item()                                    # a host tensor's read: nothing
    assert n_quiet == 0, audit.hidden
    kinds = sorted(k.split("@")[0] for k in audit.hidden)
    assert kinds == ["d2h", "dynamic", "h2d", "index"], audit.hidden
