"""The composition root (betelgeuse/assembly.py, services/assembly.py): a store opened in this process and one opened
as a real `services.store_main` child, for the same EngineConfig, plan the same slots and give bit-identical logits;
the child ends cleanly and leaves no runtime directory behind; a bad mode is one line."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.errors import BetelgeuseError

try:
    from tests.engine_helpers import ENGINE_SPEC, prompt, write_synth
except ImportError:
    from engine_helpers import ENGINE_SPEC, prompt, write_synth


def test_in_process_and_child_store_agree(tmp_path):
    from services.assembly import open_runner, open_store
    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.store.plan import plan_slots
    path = write_synth(tmp_path / "m.gguf", **ENGINE_SPEC)
    # keys off their defaults that change the slot plan (the child must be told every one of them): VRAM slots
    # sized from a budget that leaves 7 per layer after the KV cache, prefix cache and ring of these scheduler keys
    cfg = EngineConfig(model_path=str(path), vram_slots=0, host_slots=10, staging_slots=5, max_running=3,
                       max_context=256, prefix_cache_bytes=1 << 20, ring_slots=8, read_threads=2)
    with GGUFModelFile.open(str(path)) as f:
        p0 = plan_slots(f, cfg, None)
    cfg = dataclasses.replace(cfg, vram_slots="auto", vram_budget=p0.vram_fixed + 7 * p0.n_layer * p0.slot.slot_bytes)
    ids = prompt(24, ENGINE_SPEC["n_vocab"], seed=3)
    got, plans = {}, {}
    for mode in ("in-process", "process"):
        store = open_store(cfg, mode)
        runner = open_runner(cfg, store)
        try:
            plans[mode] = runner.plan
            logits, _ = runner.forward(ids, runner.new_cache(len(ids)), all_logits=True)
            got[mode] = logits
        finally:
            runner.close()
            if mode == "process":
                runtime_dir = store.cluster.runtime_dir
                assert store.close() == 0
                assert not os.path.exists(runtime_dir)
            else:
                store.close()
    same = ("n_vram", "n_host", "n_staging", "part_max", "vram_fixed", "worker_reserve", "vram_backing", "notes")
    assert [getattr(plans["process"], k) for k in same] == [getattr(plans["in-process"], k) for k in same]
    assert (plans["process"].n_vram, plans["process"].n_host, plans["process"].n_staging) == (7, 10, 5)
    assert torch.equal(got["process"], got["in-process"])


def test_bad_store_mode(tmp_path):
    from services.assembly import open_store
    with pytest.raises(BetelgeuseError, match="store mode must be one of in-process, process, got 'remote'"):
        open_store(EngineConfig(model_path=str(tmp_path / "m.gguf")), "remote")
