"""Issue 21 item 3: the VRAM budget holds by measurement (worker/vram_fit.py, ModelRunner._trim_vram,
ExpertStore.trim_vram).

After attach's warm-ups the worker measures its VRAM; over the budget, the store's plan gives back VRAM slots and the
worker attaches again with the smaller pool; below the floor it refuses, naming the numbers. The CPU has no VRAM, so
a fake device stands in for the measurement: its bytes outside torch's allocator are a constant `non_torch`, torch's
reserve 0 (the projection then takes the plan's tensors, which shrink with the VRAM tier), so a fake "2.5 slots per
layer over" must cost exactly 3 slots per layer, and one round. A smaller VRAM tier changes no logit (DESIGN §2):
the trimmed runner decodes the bits of an untrimmed one, which itself matches the reference model.
"""

from __future__ import annotations

import logging

import pytest
import torch

from betelgeuse.assembly import open_runner, open_store
from betelgeuse.config import EngineConfig
from betelgeuse.errors import BudgetError
from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM
from betelgeuse.worker import vram_fit

from engine_helpers import ENGINE_SPEC, prompt, write_synth

N_VRAM = 12                    # the plan's VRAM slots per layer (vram_slots auto under BUDGET)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("vram_fit") / "m.gguf", **ENGINE_SPEC)


def _cfg(model, **kw) -> EngineConfig:
    """vram_slots auto under a budget that holds N_VRAM slots per layer and half a slot more."""
    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.store.plan import plan_slots
    base = dict(model_path=str(model), vram_slots="auto", host_slots=3, read_threads=1, decode_consolidate_every=0,
                max_running=1)
    with GGUFModelFile.open(str(model)) as f:
        p = plan_slots(f, EngineConfig(**base), None)
    per = p.n_layer * p.slot.slot_bytes
    return EngineConfig(**{**base, "vram_budget": p.vram_fixed + N_VRAM * per + per // 2, **kw})


class FakeDevice:
    """vram_fit.measure's stand-in: `non_torch` bytes outside torch, none in it; `calls` counts the checks."""

    def __init__(self):
        self.non_torch, self.calls = 0, 0

    def __call__(self, device):
        self.calls += 1
        return self.non_torch, 0

    def over_by(self, store, slots: float):
        """non_torch such that the store's current plan projects `slots` slots per layer over its budget."""
        p = store.plan
        self.non_torch = p.vram_budget - (p.vram_fixed + p.vram_slot_bytes) + int(slots * p.n_layer * p.slot.slot_bytes)


def _decode(rn, kv, first: int, n: int) -> torch.Tensor:
    out = []
    tok = first
    for _ in range(n):
        lg, st = rn.forward([tok], kv, consolidate=False)
        out.append(lg[-1])
        tok = int(lg[-1].argmax())
    return torch.stack(out)


def _run(model, fake: FakeDevice, trim_after_prefill: float | None = None, start_over: float | None = None):
    """A runner (the fake device `start_over` slots per layer over at its first attach, if given); a prefill of 12
    tokens, a consolidation settled (the VRAM tier filled), then, with trim_after_prefill, a re-attach `that` many
    slots over; 4 decode tokens -> (logits [5, V], the store's plan, its directory snapshot)."""
    cfg = _cfg(model)
    store = open_store(cfg)
    try:
        if start_over is not None:
            fake.over_by(store.store, start_over)
        rn = open_runner(cfg, store)
        try:
            kv = rn.new_cache(32)
            lg, _ = rn.forward(prompt(12, rn.mcfg.n_vocab, seed=3), kv)
            rn.settle(10.0)
            if trim_after_prefill is not None:
                fake.over_by(store.store, trim_after_prefill)
                rn.attach()                          # as after a store restart: the check runs again
            out = torch.cat([lg[-1:], _decode(rn, kv, int(lg[-1].argmax()), 4)])
            rn.release(kv)
            return out, store.store.plan, store.store.directory.snapshot(), rn
        finally:
            rn.close()
    finally:
        store.close()


def test_over_budget_trims_the_vram_tier_and_changes_no_logit(model, monkeypatch, caplog):
    fake = FakeDevice()
    monkeypatch.setattr(vram_fit, "measure", fake)
    want, plan0, _, _ = _run(model, fake)                # the fake reports 0 bytes: it fits, untouched
    assert plan0.n_vram == N_VRAM and plan0.vram_trim is None, plan0
    assert fake.calls == 1

    from betelgeuse.model import reference_model        # the untrimmed engine is the model's (independent reference)
    ref = reference_model(str(model))
    with torch.no_grad():
        kv = ref.new_cache(32)
        rows = [ref.forward(torch.tensor(prompt(12, ENGINE_SPEC["n_vocab"], seed=3)), kv)[-1:]]
        rows += [ref.forward(torch.tensor([int(x.argmax())]), kv) for x in want[:-1]]
    # close, not equal: the engine's head runs on the prompt's last row alone, the reference's on all 12 (a matmul's
    # bits may follow its row count)
    torch.testing.assert_close(want, torch.cat(rows).float(), rtol=0, atol=1e-5)

    fake.calls = 0
    with caplog.at_level(logging.WARNING, logger="betelgeuse.worker"):
        got, plan, snap, rn = _run(model, fake, start_over=2.5, trim_after_prefill=1.2)
    assert torch.equal(got, want)                        # bits, not closeness: the VRAM tier's size is no input
    # first attach: 2.5 over -> 3 slots per layer; the re-attach's check: 1.2 over -> 2 more; each trim re-attaches
    # once and checks again (fits): 4 checks
    assert plan.n_vram == N_VRAM - 5 and plan.n_host == plan0.n_host + (5 if plan0.vram_backing else 0), plan
    assert plan.layout == plan0.layout and fake.calls == 4
    trims = [r.fields for r in caplog.records if r.getMessage() == "vram_trim"]
    assert [(t["slots_before"], t["slots_after"]) for t in trims] == [(12, 9), (9, 7)], trims
    per_mib = plan.n_layer * plan.slot.slot_bytes / 2**20
    assert trims[0]["over_mib"] == pytest.approx(2.5 * per_mib, abs=0.1) and trims[0]["allowance_mib"] == 0
    assert plan.vram_trim["slots_before"] == 9 and plan.vram_trim["slots_after"] == 7
    assert plan.vram_trim["budget"] == plan.vram_budget and plan.vram_trim["non_torch"] == fake.non_torch
    d = plan.describe()
    assert d["vram_trim"].startswith("9 -> 7 VRAM slots per layer: measured ") and d["vram_slots"] == 7, d
    assert "VRAM tier trimmed at attach" in d["why"]
    # the directory: at most 7 VRAM experts a layer; the second trim demoted filled ones to their backing slots
    tiers, hslot = snap["tier"], snap["host_slot"]
    assert ((tiers == TIER_VRAM).sum(axis=1) <= 7).all(), (tiers == TIER_VRAM).sum(axis=1)
    assert (tiers == TIER_VRAM).sum() > 0
    assert ((tiers == TIER_HOST) <= (hslot >= 0)).all() and ((tiers == TIER_DISK) <= (hslot < 0)).all()
    assert rn.warmed["vram_fit"]["slots_after"] == rn.warmed["vram_fit"]["slots_before"] == 7


def test_below_the_floor_the_worker_refuses_naming_the_numbers(model, monkeypatch, caplog):
    fake = FakeDevice()
    monkeypatch.setattr(vram_fit, "measure", fake)
    cfg = _cfg(model)
    store = open_store(cfg)
    try:
        fake.over_by(store.store, N_VRAM - 3.5)            # fitting would leave 3 slots: under top-k (4)
        with caplog.at_level(logging.ERROR, logger="betelgeuse.worker"), pytest.raises(BudgetError) as e:
            open_runner(cfg, store)
        msg = str(e.value)
        assert "the worker's VRAM does not fit its budget" in msg and "needs 3 VRAM slots per layer, under the floor " \
            "of 4 (of 12 planned" in msg, msg
        assert "outside torch's allocator" in msg and "over the VRAM budget" in msg, msg
        assert [r.fields["slots_after"] for r in caplog.records if r.getMessage() == "vram_refused"] == [3]
        assert store.store.plan.n_vram == N_VRAM             # nothing trimmed
    finally:
        store.close()


def test_check_counts_the_larger_of_torch_s_reserve_and_the_plan(model):
    """projected = outside torch + max(the plan's tensors, torch's reserve now): a reserve already past the plan
    counts as it is."""
    cfg = _cfg(model)
    store = open_store(cfg)
    try:
        p = store.store.plan
        per = p.n_layer * p.slot.slot_bytes
        f = vram_fit.check(p, 4, used=p.vram_fixed + p.vram_slot_bytes + 3 * per, torch_reserved=p.vram_fixed
                           + p.vram_slot_bytes + 3 * per)
        assert (f.non_torch, f.projected, f.slots_after) == (0, p.vram_fixed + p.vram_slot_bytes + 3 * per, N_VRAM - 3)
        f = vram_fit.check(p, 4, used=100, torch_reserved=0)
        assert f.over < 0 and f.slots_after == N_VRAM and not f.refused
    finally:
        store.close()


def test_trim_over_grpc_to_a_store_process(model, tmp_path):
    """store.proto TrimVram against a `services.store_main` child: the answer is the new plan; a trim that is not
    one (no fewer slots) is the store's clear error, not a stack trace."""
    from betelgeuse.errors import BetelgeuseError
    from services.assembly import open_store as open_process_store
    cfg = EngineConfig(model_path=str(model), vram_slots=3, host_slots=2, read_threads=1, max_running=1)
    store = open_process_store(cfg, "process", str(tmp_path / "store"))
    try:
        c = store.client
        _, plan = c.attach()
        got = c.trim_vram(1, {"non_torch": 5 << 20})
        assert (got.n_vram, got.n_host, got.layout) == (1, plan.n_host + (2 if plan.vram_backing else 0), plan.layout)
        assert got.vram_trim == {"non_torch": 5 << 20, "slots_before": 3, "slots_after": 1}, got.vram_trim
        assert c.status()["n_vram"] == 1
        with pytest.raises(BetelgeuseError, match="cannot trim the VRAM tier to 1 slots per layer: the plan has 1"):
            c.trim_vram(1, {})
    finally:
        store.close()


def test_bench_md_shows_the_trim_and_the_check():
    """bench.md: the in-process bench's slots column and attach row (services/bench/report.py), the live service's
    plan and attach rows (services/bench/serve.py, from /v1/models meta.plan and the worker's attach_warm event)."""
    from betelgeuse.store.plan import trim_text
    from services.bench import report, serve
    MiB = 1 << 20
    rec = {"used": 12_600 * MiB, "torch_reserved": 11_000 * MiB, "non_torch": 1_364 * MiB, "allowance": 1_024 * MiB,
           "plan_torch": 11_126 * MiB, "projected": 12_490 * MiB, "budget": 12_288 * MiB, "slots_before": 16,
           "slots_after": 15, "floor": 8, "slot_layer_bytes": 230 * MiB}
    fit = {**rec, "projected": 12_260 * MiB, "slots_before": 15}
    md = report.markdown({"options": {}, "cases": [{"name": "auto", "slots_requested": "auto", "plan": {
        "n_vram": 15, "n_host": 36, "vram_trim": rec}, "passes": [{"label": "cold", "schedule": "layer_major",
        "n_tokens": 8, "tok_per_s": 1.0}], "attach_s": 2.0, "kernel_warmup": {"vram_fit": fit}}]})
    assert ("| 15+36 (auto; VRAM TRIMMED at attach 16 -> 15: outside torch 1,364 (plan allowed 1,024), projected "
            "12,490 of 12,288) |") in md, md
    assert "budget check: outside torch 1,364 (plan allowed 1,024), projected 12,260 of 12,288 |" in md, md
    txt = trim_text(rec)
    assert txt == ("16 -> 15 VRAM slots per layer: measured 1,364 MiB outside torch's allocator (the plan allowed "
                   "1,024 MiB for the CUDA context), projected 12,490 MiB over the VRAM budget 12,288 MiB"), txt
    md = serve.markdown({"options": {}, "cases": [{"name": "auto", "memory": {"cgroup": "/cg"}, "plan": {
        "vram_slots": 15, "host_slots": 36, "vram_trim": txt}, "attach_warm": {
        "warm_up": "on", "compiles": "2", "non_torch_mib": "1364.0", "projected_mib": "12260.0",
        "budget_mib": "12288.0"}}]})
    assert f"distinct experts resident; VRAM TRIMMED at attach by measurement: {txt} |" in md, md
    assert "compiles 2; budget check: outside torch 1364.0 MiB, projected 12260.0 of 12288.0 MiB |" in md, md
