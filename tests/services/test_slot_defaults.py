"""Slots default to auto (issue 24, item 1): the flags, the shipped file, the image and the Kubernetes ConfigMap
plan `--vram-slots auto --host-slots auto`; the plan says what it chose and from which budgets (the store's "plan"
log line, GET /v1/models meta.plan, gRPC ModelInfo.plan); fixed counts stay possible; a budget too small is still
refused with the numbers."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

import service_helpers as h
from service_helpers import service_model  # noqa: F401  (the tiny model, a fixture)
from betelgeuse.config import GiB, MiB, EngineConfig
from betelgeuse.errors import BudgetError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.settings import AUTO, load_settings
from betelgeuse.store.plan import HEADROOM, VRAM_PARTS, plan_slots

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(service_model):
    f = GGUFModelFile.open(str(service_model))
    yield f
    f.close()


def test_the_default_config_plans_auto(tiny):
    cfg = EngineConfig(model_path=tiny.path)
    assert (cfg.vram_slots, cfg.host_slots) == (AUTO, AUTO)
    c = tiny.config
    p0 = plan_slots(tiny, cfg, None)
    slot = p0.slot.slot_bytes
    assert p0.n_vram == c.n_expert and p0.n_host == 0        # no limit, a 12 GiB "VRAM" budget: every expert
    d = p0.describe()
    assert sum(d[f"{k}_bytes"] for k in VRAM_PARTS) == d["vram_fixed_bytes"] == p0.vram_fixed > 0
    assert d["vram_budget_bytes"] == 12 * GiB and d["memory_limit_bytes"] is None and d["memory_limit_source"] == "none"
    assert (d["vram_slots_requested"], d["host_slots_requested"]) == ("auto", "auto")
    assert "vram_slots=auto -> 16 per layer: VRAM budget 12,288 MiB - fixed" in d["why"]
    assert d["staging_bytes"] == p0.n_staging * slot and d["arena_bytes"] == p0.arena_bytes
    # on the GPU, a VRAM budget for 4 slots per layer and a memory limit: each tier is sized from its budget and
    # says so (the plan needs no GPU to be computed; no prefix host tier, which would take its share of the limit)
    # (staging fixed here: its auto size depends on the limit too, test_auto_staging_leaves_the_memory_to_host_slots)
    gpu = dict(model_path=tiny.path, device="cuda", prefix_host_bytes=0, staging_slots=8)
    budget = plan_slots(tiny, EngineConfig(**gpu), None).vram_fixed + 4 * c.n_layer * slot
    cfg = EngineConfig(**gpu, vram_budget=budget)
    full = plan_slots(tiny, cfg, None)
    assert (full.n_vram, full.n_host) == (4, c.n_expert - 4)
    limit = full.worker_reserve + HEADROOM + 64 * MiB + full.arena_bytes - 4 * c.n_layer * slot   # 4 slots short
    # backing copies forced on: 4 of the n_expert - 4 host slots per layer are the VRAM tier's copies
    p = plan_slots(tiny, EngineConfig(**gpu, vram_budget=budget, vram_backing=True), limit, memory_current=64 * MiB)
    assert (p.n_vram, p.n_host, p.vram_backing, p.resident_per_layer) == (4, c.n_expert - 8, True, c.n_expert - 4)
    assert p.arena_bytes + p.worker_reserve + 64 * MiB + HEADROOM <= limit
    d = p.describe()
    assert d["memory_limit_bytes"] == limit and d["memory_limit_source"] == "cgroup memory.max"
    assert f"host_slots=auto -> {p.n_host} per layer: memory limit" in d["why"] and "in use 64 MiB" in d["why"]
    assert (d["vram_backing"], d["vram_backing_requested"], d["resident_experts_per_layer"]) == (True, "true", 12)
    assert "vram_backing=on (as configured): 12 distinct experts resident per layer of 16 (4 VRAM + 8 host; the " \
           "arena also holds the 4 VRAM experts' copies)" in d["why"]
    assert d["cuda_context_bytes"] >= GiB
    # auto (the default): host RAM binds, so the copies' slots hold other experts instead: every expert resident
    a = plan_slots(tiny, cfg, limit, memory_current=64 * MiB)
    assert (a.n_vram, a.n_host, a.vram_backing, a.host_per_layer) == (4, c.n_expert - 4, False, c.n_expert - 4)
    assert a.arena_bytes == p.arena_bytes
    d = a.describe()
    assert (d["vram_backing"], d["vram_backing_requested"], d["resident_experts_per_layer"]) == (False, "auto", 16)
    assert "vram_backing=off (auto: host RAM binds (12 slots per layer for 16 experts)" in d["why"], d["why"]
    assert "16 distinct experts resident per layer of 16 (4 VRAM + 12 host)" in d["why"]
    # ...and with the memory for every expert beside the copies, auto keeps them
    roomy = plan_slots(tiny, cfg, limit + 4 * c.n_layer * slot, memory_current=64 * MiB)
    assert (roomy.n_vram, roomy.n_host, roomy.vram_backing) == (4, c.n_expert - 4, True)
    assert "vram_backing=on (auto: the memory holds every expert beside them" in roomy.describe()["why"]
    # the same limit given as --memory-max instead of the cgroup's
    q = plan_slots(tiny, EngineConfig(**gpu, vram_budget=budget, memory_max=limit, vram_backing=True), None, 64 * MiB)
    assert (q.n_vram, q.n_host, q.describe()["memory_limit_source"]) == (p.n_vram, p.n_host, "memory_max")


def test_fixed_counts_stay_possible(tiny):
    p = plan_slots(tiny, EngineConfig(model_path=tiny.path, vram_slots=5, host_slots=15), None)
    assert (p.n_vram, p.n_host) == (5, 11)
    d = p.describe()
    assert (d["vram_slots_requested"], d["host_slots_requested"]) == ("5", "15")
    assert "vram_slots=5 as configured" in d["why"] and "host_slots=11 as configured (at most the 11" in d["why"]


def test_a_too_small_budget_is_refused_with_the_numbers(tiny):
    small = EngineConfig(model_path=tiny.path, vram_budget=1 << 20)
    with pytest.raises(BudgetError, match=r"VRAM budget 0\.00 GiB \(1048576 bytes\) does not hold the worker's "
                                          r"fixed needs .*dense weights .*KV cache for 1 x 4096 tokens"):   # auto: 1
        plan_slots(tiny, small, None)
    p0 = plan_slots(tiny, EngineConfig(model_path=tiny.path), None)
    with pytest.raises(BudgetError, match=r"slots do not fit the memory limit .*arena .*\+ worker .*\+ headroom"):
        plan_slots(tiny, EngineConfig(model_path=tiny.path), p0.worker_reserve)


def test_the_shipped_configurations_plan_auto():
    """deploy/betelgeuse.toml (installed by install.sh, baked into the image) and the Kubernetes ConfigMap."""
    s = load_settings(ROOT / "deploy" / "betelgeuse.toml", env={})
    assert (s.slots.vram_per_layer, s.slots.host_per_layer) == (AUTO, AUTO)
    docker = (ROOT / "Dockerfile").read_text()
    assert "COPY deploy/betelgeuse.toml /etc/betelgeuse/betelgeuse.toml" in docker
    assert not re.search(r"slots|per_layer", docker.split("COPY deploy/betelgeuse.toml", 1)[1])   # not edited after
    import yaml
    cm = next(d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text())
              if d and d.get("kind") == "ConfigMap")
    import tomllib
    slots = tomllib.loads(cm["data"]["betelgeuse.toml"])["slots"]
    assert slots.get("vram_per_layer", AUTO) == AUTO and slots.get("host_per_layer", AUTO) == AUTO


def test_models_and_the_log_line_show_the_chosen_plan(service_model, tmp_path):
    """A cluster on the defaults: /v1/models meta.plan, gRPC ModelInfo.plan and the store's "plan" line agree; the
    prefill chunk auto resolved to the architecture's (qwen3moe: 64) is in meta, ModelInfo and the worker's line."""
    c = h.start_cluster(service_model, tmp_path / "run", slots=None, http="auto")
    try:
        with urllib.request.urlopen(f"{c.http_url}/v1/models", timeout=10) as r:
            card = json.load(r)["data"][0]
        plan = card["meta"]["plan"]
        with c.channel() as ch:
            mi = h.stub(ch).GetModelInfo(h.pb.GetModelInfoRequest(), timeout=10).model
        store_log, worker_log = c.store.log(), c.worker.log()
    finally:
        c.stop()
    assert card["meta"]["prefill_chunk"] == mi.prefill_chunk == 64
    assert "prefill_chunk=64" in next(ln for ln in worker_log.splitlines() if "ready" in ln and "role=worker" in ln)
    assert (plan["vram_slots_requested"], plan["host_slots_requested"]) == ("auto", "auto")
    assert (plan["vram_slots"], plan["host_slots"]) == (mi.vram_slots_per_layer, mi.host_slots_per_layer)
    assert plan["vram_slots"] + plan["host_slots"] == 16          # no limit that binds: every tiny expert resident
    assert plan["vram_budget_bytes"] == 12 * GiB and plan["vram_fixed_bytes"] == sum(
        plan[f"{k}_bytes"] for k in VRAM_PARTS)
    assert plan["prefix_cache_bytes"] > 0 and plan["kv_bytes"] > 0 and plan["ring_bytes"] == 32 * plan["slot_bytes"]
    assert "vram_slots=auto ->" in plan["why"] and "vram_backing=on (auto: no memory limit" in plan["why"]
    assert plan["resident_experts_per_layer"] == mi.plan.resident_experts_per_layer == 16
    assert plan["vram_backing_requested"] == mi.plan.vram_backing_requested == "auto"
    assert plan["prefix_host_bytes"] == mi.plan.prefix_host_bytes
    assert mi.plan.vram_slots == plan["vram_slots"] and mi.plan.kv_bytes == plan["kv_bytes"]
    assert mi.plan.why == plan["why"] and mi.plan.vram_budget_bytes == 12 * GiB
    assert mi.plan.HasField("memory_limit_bytes") == (plan["memory_limit_bytes"] is not None)
    line = next(ln for ln in store_log.splitlines() if " plan " in f" {ln} " or '"plan"' in ln)
    for k in ("vram_budget_bytes", "kv_bytes", "prefix_cache_bytes", "ring_bytes", "staging_bytes",
              "memory_limit_bytes", "why"):
        assert f"{k}=" in line or f'"{k}"' in line, line


def test_auto_staging_leaves_the_memory_to_host_slots(tiny):
    """Auto staging is sized in bytes too: at most 1/8 of the memory left for the arena (and 1 GiB), so large
    experts (V4-Flash's 13-19 MB: 512 staging slots were 7-10 GB) do not take the host tier's memory. Fails when
    staging is 2 x the non-resident experts whatever their size (the host tier then gets fewer slots)."""
    from betelgeuse.store import plan as plan_mod
    # max_running fixed: with auto, 2 VRAM slots per layer (under the top-k) would buy fewer sequences more slots
    gpu = dict(model_path=tiny.path, device="cuda", prefix_host_bytes=0, max_running=8)
    c = tiny.config
    slot = plan_slots(tiny, EngineConfig(**gpu), None).slot.slot_bytes
    budget = plan_slots(tiny, EngineConfig(**gpu), None).vram_fixed + 2 * c.n_layer * slot
    cfg = EngineConfig(**gpu, vram_budget=budget, vram_backing=False)
    reserve = plan_slots(tiny, cfg, None).worker_reserve
    per_layer = c.n_layer * slot
    free = 12 * per_layer                          # room for 12 slots per layer after reserve and headroom
    p = plan_slots(tiny, cfg, reserve + HEADROOM + free, memory_current=0)
    non_resident = c.n_expert - p.n_vram
    assert 2 * non_resident * slot > free // plan_mod.STAGING_AUTO_FREE_SHARE   # the byte cap binds here
    assert p.n_staging == max(4, free // plan_mod.STAGING_AUTO_FREE_SHARE // slot)
    assert p.staging_bytes <= max(4 * slot, free // plan_mod.STAGING_AUTO_FREE_SHARE)
    # what staging does not take goes to host slots (the arena's other parts are small on this model)
    assert p.n_host >= min(non_resident, (free - p.staging_bytes) // per_layer - 1)
    assert p.arena_bytes <= free


def test_serving_auto_runs_the_plans_number_of_sequences(service_model, tmp_path, tiny):
    """Real processes on the defaults (max_running = auto) under a VRAM budget that holds the KV of 3 sequences beside
    the top-k's VRAM slots: the plan says 3 (meta.plan, ModelInfo.plan, the worker's KV capacity), and 5 clients at
    once get 3 running, 2 waiting; never more running. Fails when the worker keeps a fixed 8 (5 would run) or reads
    "auto" as anything but the plan's number."""
    import http.client
    import time
    c = tiny.config
    one = plan_slots(tiny, EngineConfig(model_path=tiny.path, max_running=1), None)
    per_seq = 2 * c.n_layer * c.n_head_kv * c.head_dim * 4096 * 4         # K and V, float32 on the CPU
    budget = one.vram_fixed + 2 * per_seq + c.n_expert_used * c.n_layer * one.slot.slot_bytes
    cl = h.start_cluster(service_model, tmp_path / "run", slots=None, http="auto",
                         settings={"budget.vram": budget, "worker.drain_grace": 2.0})
    conns = []
    try:
        with urllib.request.urlopen(f"{cl.http_url}/v1/models", timeout=10) as r:
            card = json.load(r)["data"][0]
        plan = card["meta"]["plan"]
        assert (plan["max_running"], plan["max_running_requested"]) == (3, "auto"), plan["why"]
        assert "max_running=auto -> 3 (of at most 8)" in plan["why"] and plan["kv_bytes"] == 3 * per_seq
        with cl.channel() as ch:
            mi = h.stub(ch).GetModelInfo(h.pb.GetModelInfoRequest(), timeout=10).model
        assert (mi.plan.max_running, mi.plan.max_running_requested) == (3, "auto")
        host, port = cl.http.rsplit(":", 1)
        body = json.dumps({"model": card["id"], "prompt": "Hi", "ignore_eos": True, "stream": True, "temperature": 0,
                           "max_tokens": 1000})             # the model's context: 2048
        for _ in range(5):
            x = http.client.HTTPConnection(host, int(port), timeout=30)
            x.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            conns.append(x)
        seen, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline:
            s = h.scrape(cl.worker_metrics_url)
            seen.append((h.value(s, "betelgeuse_requests_running"), h.value(s, "betelgeuse_requests_waiting")))
            if seen[-1] == (3, 2):
                break
            time.sleep(0.05)
        assert seen[-1] == (3, 2) and max(r for r, _ in seen) <= 3, seen
        assert h.value(s, "betelgeuse_kv_cache_capacity_tokens") == 3 * min(4096, c.context_length)
    finally:
        for x in conns:
            x.close()
        cl.stop()
    assert "max_running=3" in cl.worker.log(), cl.worker.log()[-2000:]
