"""Both registries serve on real loopback ports; a real HTTP GET of /metrics parses with
prometheus_client's own parser and has the expected names, types and units."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from betelgeuse import metrics as bm


def _scrape(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fam, sample_name: str, **labels) -> float:
    for s in fam.samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {sample_name}{labels} in {fam.name}")


@pytest.fixture
def served():
    w, s = bm.make_worker_metrics("9.9.9"), bm.make_store_metrics("9.9.9")
    servers = [bm.serve_metrics(m.registry, "127.0.0.1", 0) for m in (w, s)]
    yield w, s, [p for _, p in servers]
    for srv, _ in servers:
        srv.shutdown()
        srv.server_close()


WORKER = {  # family name (without _total) -> type
    "betelgeuse_prompt_tokens": "counter",
    "betelgeuse_generation_tokens": "counter",
    "betelgeuse_engine_busy_seconds": "counter",
    "betelgeuse_time_to_first_token_seconds": "histogram",
    "betelgeuse_inter_token_latency_seconds": "histogram",
    "betelgeuse_request_duration_seconds": "histogram",
    "betelgeuse_request_queue_seconds": "histogram",
    "betelgeuse_requests": "counter",
    "betelgeuse_requests_finished": "counter",
    "betelgeuse_requests_running": "gauge",
    "betelgeuse_requests_waiting": "gauge",
    "betelgeuse_expert_reads": "counter",
    "betelgeuse_disk_wait_seconds": "counter",
    "betelgeuse_host_to_device_bytes": "counter",
    "betelgeuse_expert_slots": "gauge",
    "betelgeuse_vram_used_bytes": "gauge",
    "betelgeuse_cgroup_memory_bytes": "gauge",
    "betelgeuse_build_info": "gauge",  # Info: the text parser sees a gauge
    "betelgeuse_model_info": "gauge",
    "betelgeuse_ready": "gauge",
    "betelgeuse_gc_pause_seconds": "histogram",
    "process_resident_memory_bytes": "gauge",
}
STORE = {
    "betelgeuse_disk_read_bytes": "counter",
    "betelgeuse_disk_reads": "counter",
    "betelgeuse_disk_active_seconds": "counter",
    "betelgeuse_disk_read_duration_seconds": "histogram",
    "betelgeuse_disk_direct_io": "gauge",
    "betelgeuse_expert_slots": "gauge",
    "betelgeuse_arena_bytes": "gauge",
    "betelgeuse_prefix_file_entries": "gauge",
    "betelgeuse_prefix_loaded_entries": "gauge",
    "betelgeuse_prefix_saved_bytes": "counter",
    "betelgeuse_prefix_last_save_timestamp_seconds": "gauge",
    "betelgeuse_cgroup_memory_bytes": "gauge",
    "betelgeuse_build_info": "gauge",  # Info: the text parser sees a gauge
    "betelgeuse_ready": "gauge",
    "process_resident_memory_bytes": "gauge",
}


def test_worker_and_store_serve_expected_families(served):
    w, s, (wport, sport) = served
    assert wport != sport and wport > 0
    w.prompt_tokens.inc(512)
    w.generation_tokens.inc(32)
    w.busy_seconds.labels(phase="prefill").inc(2.5)
    w.ttft.observe(3.0)
    w.expert_reads.labels(tier="disk", phase="prefill").inc(7)
    w.requests.labels(method="Generate", code="OK").inc()
    w.set_cgroup_reader(lambda: 1234.0, lambda: 12 * 2**30)
    s.disk_read_bytes.labels(reason="demand").inc(4096)
    s.disk_active_seconds.inc(0.25)
    s.disk_read_duration.observe(0.004)
    s.expert_slots.labels(tier="host", state="used").set(720)

    fams = {"worker": _scrape(wport), "store": _scrape(sport)}
    for role, want in (("worker", WORKER), ("store", STORE)):
        got = fams[role]
        for name, typ in want.items():
            assert name in got, f"{role} /metrics lacks {name}"
            assert got[name].type == typ, (role, name, got[name].type)
        for name, fam in got.items():
            if not name.startswith("betelgeuse_"):
                continue
            # base units only: seconds and bytes, never ms/MB
            assert not any(u in name for u in ("_ms", "_milliseconds", "_mb", "_kb", "_gb")), name
            if fam.type == "histogram":
                assert name.endswith(("_seconds", "_tokens")), name
            if fam.type == "counter":
                assert all(x.name.endswith(("_total", "_created")) for x in fam.samples), name
        assert _value(got["betelgeuse_build_info"], "betelgeuse_build_info", role=role, version="9.9.9") == 1

    wf = fams["worker"]
    assert _value(wf["betelgeuse_prompt_tokens"], "betelgeuse_prompt_tokens_total") == 512
    assert _value(wf["betelgeuse_engine_busy_seconds"], "betelgeuse_engine_busy_seconds_total", phase="prefill") == 2.5
    assert _value(wf["betelgeuse_engine_busy_seconds"], "betelgeuse_engine_busy_seconds_total", phase="decode") == 0
    assert _value(wf["betelgeuse_time_to_first_token_seconds"], "betelgeuse_time_to_first_token_seconds_bucket",
                  le="5.0") == 1
    assert _value(wf["betelgeuse_expert_reads"], "betelgeuse_expert_reads_total", tier="disk", phase="prefill") == 7
    # every tier x phase exists before anything happened, so rate() has a series from the start
    assert {(x.labels["tier"], x.labels["phase"]) for x in wf["betelgeuse_expert_reads"].samples
            if x.name.endswith("_total")} == {(t, p) for t in bm.TIERS for p in bm.PHASES}
    assert _value(wf["betelgeuse_requests"], "betelgeuse_requests_total", method="Generate", code="OK") == 1
    assert _value(wf["betelgeuse_requests"], "betelgeuse_requests_total", method="Generate", code="INTERNAL") == 0
    assert _value(wf["betelgeuse_cgroup_memory_bytes"], "betelgeuse_cgroup_memory_bytes", kind="current") == 1234
    assert _value(wf["betelgeuse_cgroup_memory_bytes"], "betelgeuse_cgroup_memory_bytes", kind="max") == 12 * 2**30

    sf = fams["store"]
    assert _value(sf["betelgeuse_disk_read_bytes"], "betelgeuse_disk_read_bytes_total", reason="demand") == 4096
    assert _value(sf["betelgeuse_disk_active_seconds"], "betelgeuse_disk_active_seconds_total") == 0.25
    assert _value(sf["betelgeuse_disk_read_duration_seconds"], "betelgeuse_disk_read_duration_seconds_count") == 1
    assert _value(sf["betelgeuse_expert_slots"], "betelgeuse_expert_slots", tier="host", state="used") == 720


def test_registries_are_independent():
    a, b = bm.make_worker_metrics(), bm.make_worker_metrics()  # no "Duplicated timeseries" error
    a.prompt_tokens.inc(3)
    assert b.registry.get_sample_value("betelgeuse_prompt_tokens_total") == 0
    assert a.registry.get_sample_value("betelgeuse_prompt_tokens_total") == 3
    bm.make_store_metrics()


def test_port_zero_picks_distinct_free_ports():
    regs = [bm.make_store_metrics().registry for _ in range(2)]
    servers = [bm.serve_metrics(r, "127.0.0.1", 0) for r in regs]
    try:
        assert len({p for _, p in servers}) == 2
    finally:
        for srv, _ in servers:
            srv.shutdown()
            srv.server_close()
