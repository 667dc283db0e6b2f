"""The model interface written down (model/interface.py) and the architecture registry (model/registry.py): every
registered architecture's engine model has the MoEModel surface with flags that agree with its methods, its
reference is the same model plus file experts, and the registry's memory facts (what the store's slot plan sizes a
sequence's state by) hold for the state the model really allocates."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from betelgeuse.gguf import SUPPORTED_ARCHS
from betelgeuse.gguf.layouts import LAYOUTS
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.model.interface import EngramModel, LaneDecode, MoEModel, SequenceState, check_model
from betelgeuse.model.registry import ARCHS, arch_of, engine_model, reference_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """One small file per registered architecture."""
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    ds4 = tmp_path_factory.mktemp("iface") / "ds4.gguf"
    write_model(ds4, replace(spec_from_preset("ds4-tiny"), expert_qtype="Q8_0", seed=3), progress=False)
    ds41 = ds4.with_name("ds41.gguf")
    write_model(ds41, replace(spec_from_preset("ds41-tiny"), expert_qtype="Q8_0", seed=3), progress=False)
    return {"qwen3moe": tiny_model, "deepseek4": ds4, "deepseek41": ds41}


def test_registry_covers_the_layouts():
    assert set(ARCHS) == set(LAYOUTS) == set(SUPPORTED_ARCHS)
    for name, a in ARCHS.items():
        assert a.name == name and a.layout is LAYOUTS[name]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_engine_model_has_the_surface_its_flags_say(files, name):
    a = ARCHS[name]
    with GGUFModelFile.open(files[name]) as f:
        assert arch_of(f.config) is a
        m = engine_model(f, torch.device("cpu"), torch.float32)
        assert type(m) is a.engine_class()
        assert isinstance(m, MoEModel)
        check_model(m)
        assert isinstance(m, LaneDecode) == m.lane_decode       # the lane methods exist exactly where claimed
        assert a.prefix_cache == (m.prefix_reuse != "none")              # the store's plan and the engine agree
        assert not a.prefix_cache or a.prefix_host          # K/V blocks and snapshots have a host tier
        assert isinstance(m.new_cache(8), SequenceState)
        # the state the plan budgets is the state the model allocates, before and after a prompt through every layer
        n, dt = 40, 4
        cache = m.new_cache(n)
        ids = m.check_ids(list(range(3, 3 + n)))
        pos = cache.begin(n)
        assert isinstance(m, EngramModel) == (name == "deepseek41")
        if isinstance(m, EngramModel):          # rows from the file's map here (the engine's: from the store)
            from betelgeuse.model.engram import FileRows
            m.engram_begin(cache, ids, FileRows(f, f.config.ds41.engram, m.device, m.dtype))
        x = m.embed(ids)
        for layer in range(f.config.n_layer):
            x = m.attention_block(layer, x, cache, pos)
        cache.commit()
        # every state tensor is allocated whole by new_cache (qwen3moe's K/V, deepseek4's and deepseek41's rings,
        # windows, entries)
        assert m.static_decode and cache.nbytes() == a.state_bytes(f.config, n, dt)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_reference_is_the_engine_model_plus_file_experts(files, name):
    ref = reference_model(files[name])
    assert type(ref) is ARCHS[name].reference_class()
    assert isinstance(ref, ARCHS[name].engine_class()) and isinstance(ref, MoEModel)


def test_a_flag_without_its_methods_is_caught(files):
    from betelgeuse.model.deepseek4 import Deepseek4Model
    with GGUFModelFile.open(files["deepseek4"]) as f:
        m = engine_model(f, torch.device("cpu"), torch.float32)
    for flags in ({"lane_decode": True, "static_decode": False},        # lanes without the static form
                  {"lane_decode": True, "lane_rows": None}):             # a lane method missing
        m.__class__ = type("Claims", (Deepseek4Model,), flags)
        with pytest.raises(AssertionError, match="lane_decode needs"):
            check_model(m)


def test_the_registry_and_the_slot_plan_need_no_torch():
    """The store process sizes its plan from the registry; importing torch there would cost it hundreds of MB."""
    code = ("import sys, betelgeuse.store.plan, betelgeuse.model.registry as r; "
            "print('torch' in sys.modules, sorted(r.ARCHS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.split()[0] == "False", out.stdout + out.stderr
