"""Decode with every expert in VRAM: no disk, no host sync (the setup of deploy/device/profile_pass.py, on the CPU).

With vram_slots = n_expert the VRAM tier can hold every expert, but the residency policy places only experts that
were used (store/residency.py: never-used experts keep their place on disk), so a warm-up whose prompts route to
some experts only leaves the others on disk: a layer is then not wholly in VRAM (ExpertCache.all_vram), decode takes
the host-synced partial path with its guesses and reads the unseen experts from disk (staging holds 4 slots here,
so the same misses are read again step after step). Once warm-up passes have used every expert (the profile script
warms until they have), a decode step must read nothing (store reader's bytes) and route every layer in VRAM
(LayerStats.synced False), with or without the VRAM tier's host backing copies (no re-fill from disk per pass)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from betelgeuse.assembly import open_runner, open_store
from betelgeuse.config import EngineConfig
from betelgeuse.gguf.synth import PRESETS, write_model

E = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("all_vram") / "tiny-16.gguf"
    write_model(path, replace(PRESETS["tiny"], n_layer=3, router_skew=1.0, seed=3), progress=False)
    return path


def _warm_every_expert(rn, store, rounds=8):
    """Prefill passes of random prompts (each consolidated and settled) until every layer is wholly in VRAM."""
    g = torch.Generator().manual_seed(1)
    for _ in range(rounds):
        if rn.cache.all_vram.all():
            return
        rn.forward(torch.randint(0, 1024, (64,), generator=g).tolist(), rn.new_cache(80))
        rn.settle()
    raise AssertionError(f"warm-up left experts out of VRAM: {store.tier_counts()}")


@pytest.mark.parametrize("backing", [True, False])
def test_decode_with_every_expert_in_vram_reads_nothing_and_never_syncs(model, backing):
    cfg = EngineConfig(model_path=str(model), device="cpu", vram_slots=E, host_slots=0, vram_backing=backing,
                       vram_budget=1 << 30, max_context=128, prefix_cache_bytes=0, prefix_host_bytes=0)
    opened = open_store(cfg)
    store = opened.store
    rn = open_runner(cfg, opened)
    try:
        ids = [(7 * i + 3) % 1000 for i in range(8)]
        rn.forward(ids, rn.new_cache(16))
        rn.settle()
        # an 8-token prompt routes to some experts only: they alone are placed, the VRAM tier has room left
        assert not rn.cache.all_vram.any() and store.tier_counts()["vram"] < 3 * E
        _warm_every_expert(rn, store)
        assert store.tier_counts()["vram"] == 3 * E
        kv = rn.new_cache(64)
        lg, _ = rn.forward(ids, kv, consolidate=False)
        before = store.status()
        for _ in range(12):
            lg, st = rn.forward([int(lg[-1].argmax())], kv, consolidate=False)
            assert st.kind == "decode" and st.reads["disk"] == 0 and st.reads["host"] == 0, st.reads
            assert len(st.layers) == 3 and not any(ls.synced for ls in st.layers), [ls.synced for ls in st.layers]
            assert st.guessed == 0 and st.prefetched == 0
        after = store.status()
        for k in ("disk_bytes", "disk_reads", "demand_loads", "readahead_reads", "staged_hits"):
            assert after[k] == before[k], (k, before[k], after[k])
    finally:
        rn.close()
        opened.close()
