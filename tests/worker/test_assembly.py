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


# the parts a composition root wires, and the modules allowed to build them: the two assembly modules; the engine
# (its own runner); the store process (it is the store); the worker process (it connects to a store it did not start)
PARTS = ("ExpertStore", "InProcessStoreClient", "GrpcStoreClient", "ModelRunner", "LLMEngine")
BUILDERS = {"betelgeuse/assembly.py": {"ExpertStore", "InProcessStoreClient", "ModelRunner", "LLMEngine"},
            "services/assembly.py": {"GrpcStoreClient"},
            "betelgeuse/worker/engine.py": {"ModelRunner"},
            "services/store_main.py": {"ExpertStore"},
            "services/worker_main.py": {"GrpcStoreClient", "LLMEngine"}}


# children that are not service processes (no store, worker or server in them), each with its reason
NOT_SERVICE_CHILDREN = {
    "deploy/device/kernel_roofline.py": "compile workers that warm Triton's cache in parallel, then exit",
    "services/bench/procs.py": "the bench's VRAM sampler (services/bench/vram_peak.py: stdlib and NVML, piped to the "
                               "bench, no service), outside the cgroup, ended when the bench closes its stdin",
}


def test_parts_are_wired_in_one_place():
    """No module of the library, the application, the device scripts or the tests' process helpers builds a store,
    a client, a runner or an engine by hand (they go through open_store / open_runner / open_engine; BUILDERS are
    the exceptions), nor starts a child process but through the one launcher (services/launcher.py)."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    files = [p for d in ("betelgeuse", "services", "deploy/device") for p in sorted((root / d).rglob("*.py"))
             if "services/pb/" not in p.as_posix()] + [root / "tests" / "engine_helpers.py",
                                                       root / "tests" / "service_helpers.py"]
    assert len(files) > 50
    bad = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in PARTS and name not in BUILDERS.get(rel, ()):
                    bad.append(f"{rel}:{node.lineno}: {name}(...)")
                if name == "Popen" and rel != "services/launcher.py" and rel not in NOT_SERVICE_CHILDREN:
                    bad.append(f"{rel}:{node.lineno}: Popen(...) beside the launcher")
    assert not bad, "parts built outside the assembly:\n  " + "\n  ".join(bad)
