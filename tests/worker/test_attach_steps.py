"""Issue 21: attach's compile warm-ups are never fatal, can be turned off, and each attach step's VRAM is measured
(worker/attach_steps.py, worker/runner.py attach).

A warm-up that raises (MoEStep.warm_routes, MoEStep.warm_kernels, ModelRunner.warm_decode) leaves a warning and
{"failed": error} in `warmed`, and the runner decodes the same logits as one whose warm-ups did not fail;
engine.warm_up = "off" calls none of them. On CUDA each step's device-wide and torch-reserved bytes are read before
and after (vram_now); here a fake vram_now stands in for the device, and a warm-up that "puts" 300 MiB on it, 60 of
them in torch's allocator, shows as +300 / +60 (outside torch +240) in its own step alone.
"""

from __future__ import annotations

import logging

import pytest
import torch

from betelgeuse.worker import attach_steps
from betelgeuse.worker.moe_step import MoEStep
from betelgeuse.worker.runner import ModelRunner

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth

MiB = 1 << 20
WARM_UPS = ("warm_routes", "warm_kernels", "warm_decode")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("attach_steps") / "m.gguf", **ENGINE_SPEC)


def _logits(model, **cfg) -> tuple[torch.Tensor, dict | None]:
    """Attach, a prefill of 6 tokens and 2 decode tokens -> (their logits, the runner's warmed)."""
    rn, st = in_process_runner(model, 2, 3, decode_consolidate_every=0, max_running=1, read_threads=1, **cfg)
    try:
        kv = rn.new_cache(16)
        lg, _ = rn.forward(prompt(6, rn.mcfg.n_vocab, seed=5), kv)
        out = [lg[-1]]
        for _ in range(2):
            lg, _ = rn.forward([int(out[-1].argmax())], kv, consolidate=False)
            out.append(lg[-1])
        rn.release(kv)
        return torch.stack(out), rn.warmed
    finally:
        close_runner(rn, st)


def _raise(what: str):
    def boom(*a, **kw):
        raise RuntimeError(f"{what} blew up\non two lines")
    return boom


def test_a_failing_warm_up_never_stops_attach(model, monkeypatch, caplog):
    want, _ = _logits(model)
    monkeypatch.setattr(MoEStep, "warm_routes", _raise("routes"))
    monkeypatch.setattr(MoEStep, "warm_kernels", _raise("kernels"))
    monkeypatch.setattr(ModelRunner, "warm_decode", _raise("decode"))
    with caplog.at_level(logging.WARNING, logger="betelgeuse.worker"):
        got, warmed = _logits(model)
    assert torch.equal(got, want)
    assert warmed == {"routes": {"failed": "RuntimeError: routes blew up on two lines"},
                      "kernels": {"failed": "RuntimeError: kernels blew up on two lines"},
                      "decode": {"failed": "RuntimeError: decode blew up on two lines"}}, warmed
    failed = [r for r in caplog.records if r.getMessage() == "warm_up_failed"]
    assert [r.fields["step"] for r in failed] == list(WARM_UPS), failed
    assert all(r.levelno == logging.WARNING and "blew up" in r.fields["error"] for r in failed)


def test_an_interrupt_still_stops_attach(model, monkeypatch):
    """Only Exception is a failed warm-up: a KeyboardInterrupt is the operator's, and stops attach."""
    monkeypatch.setattr(MoEStep, "warm_kernels", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        _logits(model)


def test_warm_up_off_runs_none_of_them(model, monkeypatch):
    called = []
    for cls, name in ((MoEStep, "warm_routes"), (MoEStep, "warm_kernels"), (ModelRunner, "warm_decode")):
        monkeypatch.setattr(cls, name, lambda *a, name=name, **kw: called.append(name))
    _, warmed = _logits(model, warm_up="off")
    assert called == [] and warmed == {"warm_up": "off"}, (called, warmed)
    _, warmed = _logits(model)                                  # on (the default): each called once
    assert called == list(WARM_UPS), called


def test_each_step_s_vram_is_its_own(model, monkeypatch):
    """A fake device: warm_kernels puts 300 MiB on it (60 in torch's reserve), warm_decode 20 MiB of scratch that
    its empty_cache gives back but that raised torch's peak; each shows in its own step alone."""
    dev = {"used": 1000 * MiB, "reserved": 500 * MiB, "peak": 500 * MiB}
    monkeypatch.setattr(attach_steps, "vram_now", lambda device: (dev["used"], dev["reserved"], dev["peak"]))

    def kernels(self, model, force=False):
        dev["used"] += 300 * MiB
        dev["reserved"] += 60 * MiB
        dev["peak"] = max(dev["peak"], dev["reserved"])
        return {"groups": 3}

    def decode(self, force=False):
        dev["peak"] = max(dev["peak"], dev["reserved"] + 20 * MiB)
        return {"seconds": 0.1}
    monkeypatch.setattr(MoEStep, "warm_kernels", kernels)
    monkeypatch.setattr(ModelRunner, "warm_decode", decode)
    _, warmed = _logits(model)
    v = warmed["vram"]
    assert list(v) == ["session", "flex_cache", "moe_step", "warm_routes", "warm_kernels", "warm_decode"], v
    assert v["warm_kernels"] == {"device_mib": 300.0, "torch_reserved_mib": 60.0, "used_mib": 1300.0,
                                 "torch_peak_mib": 560.0}, v
    assert v["warm_decode"] == {"device_mib": 0.0, "torch_reserved_mib": 0.0, "used_mib": 1300.0,
                                "torch_peak_mib": 580.0}, v
    assert all(v[s]["device_mib"] == 0 for s in ("session", "flex_cache", "moe_step", "warm_routes")), v
    assert warmed["kernels"] == {"groups": 3} and warmed["decode"] == {"seconds": 0.1}
    from services.bench.report import attach_vram
    txt = attach_vram(warmed)
    assert "warm_kernels +300/+60 (outside torch +240) (torch peak 560)" in txt, txt
    assert "warm_decode +0/+0 (torch peak 580)" in txt, txt
    # the same fake device is the budget check's (worker/vram_fit.py): 740 outside torch + torch's 560 (more than
    # the tiny plan's tensors) of the default 12 GiB budget
    assert "moe_step" not in txt and txt.endswith("device used after 1,300; budget check: outside torch 740 (plan "
                                                  "allowed 0), projected 1,300 of 12,288"), txt
    from services.bench.report import markdown                 # bench.md: one row per case, in its own table
    md = markdown({"options": {}, "cases": [{"name": "auto p64", "slots_requested": "auto", "plan": {}, "passes": [],
                                             "attach_s": 1.25, "kernel_warmup": warmed}]})
    assert f"| auto p64 | 1.25 | – | {txt} |" in md, md


def test_the_bench_harness_releases_its_states(model):
    """The in-process bench made a state per pass and released none: the runner kept counting them against the plan's
    KV reservation (the flex cache's room), and the ds4 bench's re-attach found a free reservation of -99 MB for
    warm_decode's scratch states. Its states (services/bench/harness.py _state / _once) are released now."""
    from services.bench.harness import Harness
    h = Harness.__new__(Harness)                # the state bookkeeping alone (no options, no store of its own)
    h.states = []
    rn, st = in_process_runner(model, 2, 3, decode_consolidate_every=0, max_running=1, read_threads=1)
    try:
        ids = prompt(6, rn.mcfg.n_vocab, seed=5)
        kv0 = rn.new_cache(16)
        want = rn.forward(ids, kv0, consolidate=False)[0]
        assert rn.kv_bytes > 0                  # a state not released stays counted (the old harness's way)
        rn.release(kv0)
        got = h._once(rn, ids, 16)
        assert torch.equal(got, want) and rn.kv_bytes == 0 and h.states == []
        kv = h._state(rn, 16)
        assert rn.kv_bytes > 0 and h.states == [kv]
        h._release(rn, kv)
        h._release(rn, kv)                      # once only
        assert rn.kv_bytes == 0 and h.states == []
    finally:
        close_runner(rn, st)
