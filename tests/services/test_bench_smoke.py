"""`betelgeuse bench` at a tiny geometry on the CPU: it runs end to end (a real store process, a real
cgroup where the machine allows one, real O_DIRECT reads) within its time budget and writes a
well-formed bench.json / bench.md / bench.png. No performance targets: those are judged on the GPU."""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
BUDGET = 40.0


def _png_chunks(data: bytes):
    """Parse a PNG by the spec: signature, then (length, type, data, CRC) chunks; check every CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, out = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"bad CRC in {kind!r}"
        out.append((kind, body))
        pos += 12 + n
    return out


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    out = work / "out"
    cmd = [sys.executable, "-m", "services.bench.cli", "--quick", "--preset", "tiny", "--router-skew", "1",
           "--variant-skew", "0", "--variant-layers", "2", "--slots", "2+6,auto", "--prompts", "8,16",
           "--standard-prompts", "8", "--decode", "4", "--memory-max", "4G", "--time-budget", str(BUDGET),
           "--disk-sample", "4MiB", "--work-dir", str(work), "--out", str(out), "--run-name", "smoke", "--gpu-marks"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=BUDGET + 90)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text()), p


def test_runs_within_budget_and_writes_json(bench_run):
    out, r, _ = bench_run
    assert r["status"] == "complete" and r["errors"] == []
    assert r["elapsed_s"] < BUDGET + 15, r["elapsed_s"]          # the budget is honoured, model writing included
    assert r["models"]["main"]["bytes"] == os.path.getsize(r["models"]["main"]["path"])
    assert r["command"].startswith("betelgeuse bench") and r["machine"]["torch"]
    first = r["cases"][0]
    assert first["router_skew"] == 1.0 and first["plan"]["n_vram"] == 2 and first["plan"]["n_host"] == 6
    labels = [p["label"] for p in first["passes"]]
    assert labels[:2] == ["cold", "warm"], labels
    cold, warm = first["passes"][:2]
    # a fresh store has empty slots: every expert of the cold pass comes from disk
    assert cold["reads"]["disk"] > 0 and cold["reads"]["vram"] == cold["reads"]["host"] == 0
    assert cold["disk_share"] == 1.0 and cold["disk_bytes"] > 0
    assert warm["reads"]["vram"] + warm["reads"]["host"] > 0          # consolidation placed experts
    for p in (cold, warm):
        assert p["n_tokens"] == 8 and p["tok_per_s"] > 0 and len(p["layers"]) == first["n_layer"]
        b = p["bound"]
        assert b["bound_s"] == max(b["disk_s"], b["h2d_s"], b["compute_s"]) > 0
        assert b["achieved"] == pytest.approx(b["bound_s"] / p["seconds"])
        # the first case is bounded by the fastest disk rate beside it: the samples just before and just after it
        # (the run's first two) or its passes' own reads
        own = p["store_disk_bytes"] * p["read_threads"] / p["store_disk_busy_s"] if p["store_disk_busy_s"] else 0.0
        # each side sampled in both patterns (random, layer); its rate the faster of the two
        d = r["ceilings"]["disk"][:4]
        assert [s["pattern"] for s in d] == ["random", "layer"] * 2
        assert [max(d[0]["bps"], d[1]["bps"]), max(d[2]["bps"], d[3]["bps"])] == [first["disk_bps"], first["disk_bps_after"]]
        assert b["disk_bps"] == pytest.approx(max(first["disk_bps"], first["disk_bps_after"], own), rel=1e-9)
        assert b["disk_s"] == pytest.approx(p["disk_bytes"] / b["disk_bps"], rel=1e-9) and not b["bound_wrong"]
        assert b["h2d_s"] == pytest.approx(p["h2d_bytes"] / r["ceilings"]["h2d_bps"], rel=1e-9)
    assert r["ceilings"]["h2d_bps"] > 0 and r["ceilings"]["disk"][0]["bps"] > 0
    # the compute ceiling: the engine's own kernels at 1, 16 and 64 rows per expert, more rows never cheaper
    mm = {int(k): v for k, v in r["ceilings"]["mm_s"].items()}
    assert sorted(mm) == [1, 16, 64] and all(v > 0 for v in mm.values()) and all(v > 0 for v in r["ceilings"]["hbm_bps"].values())
    # ... per expert type of the model (gate-up / down), whose layer-weighted mean the bound uses
    by = r["ceilings"]["by_type"]
    assert sum(v["layers"] for v in by.values()) == first["n_layer"] and all(
        "/" in t and sorted(int(k) for k in v["hbm_bps"]) == [1, 16, 64] for t, v in by.items()), by
    for p in (cold, warm):
        # host cost: host time + blocked time = the pass's wall; per application = host time / applications
        assert p["host_s"] + p["blocked_s"] == pytest.approx(p["seconds"], rel=1e-6)
        assert p["host_us_per_application"] == pytest.approx(p["host_s"] / p["loads"] * 1e6)
        assert p["store_calls"] >= 2
    for case in r["cases"]:
        assert case["arena_mappings_after_detach"] == 0, case["name"]    # old arenas never linger
        assert case["store_exit"] == 0, case.get("store_error")
        if "decode" in case:
            d = case["decode"]
            assert 1 <= d["tokens"] <= 4 and d["tg_peak"] >= d["tg_mean"] > 0
            # the disk's busy share of the decode's wall (reads in flight / wall): a fraction, the reads' own
            assert 0 <= d["disk_busy_fraction"] <= 1 and d["disk_active_ms_per_token"] >= 0
            assert d["store_disk_active_s"] <= d["store_disk_busy_s"] + 1e-6
            # the host time's parts (worker/stats.py): store messages by kind, the expert steps, the rest
            assert d["store_s"] + d["moe_host_s"] + d["other_host_s"] == pytest.approx(d["host_s"], abs=1e-4)
            assert d["store_s"] == pytest.approx(sum(d["store_ms_per_token"].values()) * d["tokens"] / 1e3)
            assert sum(d["store_messages_per_token"].values()) == pytest.approx(d["store_calls_per_token"])
            # where the disk idled (services/bench/disk_idle.py, from the store process's gap log): both parts >= 0,
            # idle + active = the decode's span, and that active time agrees with the store's own active counter
            # (a separate clock: it spans the status calls around the run, a few ms more)
            idle = d["disk_idle"]
            assert idle["tokens"] == d["tokens"] and idle["gaps_complete"] is True
            assert idle["between_s"] >= 0 and idle["within_s"] >= 0 and 0 <= idle["outside_s"] <= idle["between_s"]
            assert idle["idle_s"] + idle["active_s"] == pytest.approx(idle["span_s"])
            assert idle["span_s"] == pytest.approx(sum(d["token_s"]), abs=0.05)
            assert 0 <= idle["active_s"] <= d["store_disk_active_s"] + 0.005, (idle, d["store_disk_active_s"])
            assert idle["active_s"] >= d["store_disk_active_s"] - 0.05, (idle, d["store_disk_active_s"])
            # the chain of the gaps a layer's message ended (disk_idle.CHAIN): its parts within those gaps' total
            from services.bench.disk_idle import CHAIN, GPU
            for where, c in idle.get("chain", {}).items():
                assert all(c[k] >= 0 for k in CHAIN) and c["own_read"] <= c["gaps"], c
                assert sum(c[k] for k in CHAIN) <= idle[f"{where}_ms_per_token"] + 1e-6, (where, c, idle)
                # gpu cut at the worker's device marks (--gpu-marks): its parts sum to it
                assert all(c[k] >= 0 for k in GPU) and sum(c[k] for k in GPU) == pytest.approx(c["gpu"]), c
    # every planned case either ran or is listed as skipped
    ran = {c["name"] for c in r["cases"]}
    assert "2+6 p8" in ran
    assert all(s["reason"] for s in r["skipped"])


def test_cgroup_holds_both_processes(bench_run):
    _, r, _ = bench_run
    mem = r["memory"]
    if mem.get("cgroup") is None:
        pytest.skip(f"no memory cgroup on this machine: {mem.get('reason')}")
    assert mem["limit"] == 4 << 30 and mem["oom_kills"] == 0 and mem["peak"] > 0
    for case in r["cases"]:                      # read from /proc/<pid>/cgroup during the run
        assert case["cgroups"]["store"] == case["cgroups"]["worker"] == mem["cgroup"]
    assert not os.path.exists(mem["cgroup"])     # removed afterwards


def test_markdown_and_png_well_formed(bench_run):
    out, r, _ = bench_run
    md = (out / "bench.md").read_text()
    n_passes = sum(len(c["passes"]) for c in r["cases"])
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and ("| layer_major |" in ln or "| standard |" in ln)]
    assert len(rows) == n_passes, md
    header = next(ln for ln in md.splitlines() if ln.startswith("| Case | Router |"))
    assert all(ln.count("|") == header.count("|") for ln in rows)
    assert all(ln.split(" | ")[1] in ("skew 1", "uniform (worst case)") for ln in rows), rows   # the case's router
    assert "PP tok/s" in header and "Disk read share" in header and "Disk wait ms" in header
    assert "Peak cgroup memory" in md and "Peak VRAM" in md
    lines = md.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("| Case | Tokens |"))
    assert "Store messages / token by kind" in lines[i]
    decode = list(itertools.takewhile(lambda ln: ln.startswith("| "), lines[i + 2:]))
    assert decode and all(ln.count("|") == lines[i].count("|") for ln in decode), decode
    chunks = _png_chunks((out / "bench.png").read_bytes())
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    w, h = struct.unpack(">II", chunks[0][1][:8])
    assert w >= 100 and h >= 100
    zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))   # the image data inflates


def test_routing_trace_drives_the_passes(tmp_path):
    """`bench --routing-trace`: every pass's experts come from the trace (here: each token takes the previous token's
    experts but one, a made-up routing far from the model's), the report says the outputs are meaningless, and the
    routing the case records is the trace's, token for token."""
    from betelgeuse.gguf.synth import PRESETS
    from betelgeuse.routing.trace import write_trace
    from betelgeuse.routing_stats import trace_stats
    s = PRESETS["tiny"]
    L, E, k = 2, s.n_expert, s.n_expert_used
    ids = np.array([[[(t // 2 + r) % E for r in range(k)]] * L for t in range(64)])    # [T, L, k]
    write_trace(tmp_path / "t.bgrt", ids, E)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "services.bench.cli", "--quick", "--preset", "tiny", "--layers", str(L),
           "--routing-trace", str(tmp_path / "t.bgrt"), "--slots", "2+6", "--prompts", "8", "--standard-prompts", "8",
           "--decode", "3", "--memory-max", "4G", "--time-budget", "60", "--disk-sample", "4MiB",
           "--work-dir", str(tmp_path), "--out", str(out), "--run-name", "replay"]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((out / "bench.json").read_text())
    case = r["cases"][0]
    assert case["router"] == "REPLAYED t.bgrt" and not any("variant" in c["name"] for c in r["cases"])
    rt = case["routing"]
    want = trace_stats(ids[:8], E)["overall"]
    assert rt["prompt"]["repeat_next"] == pytest.approx(want["repeat_next"])
    assert want["repeat_next"] == pytest.approx((4 + 3 * (k - 1) / k) / 7)     # odd tokens repeat all, even k-1
    assert "Routing REPLAYED" in (out / "bench.md").read_text()
    bad = subprocess.run(cmd[:-4] + ["--layers", "3", "--out", str(tmp_path / "o2")], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=150)
    assert bad.returncode == 2 and "is for 2 layers" in bad.stderr


def test_decode_census_and_no_monitor_thread(bench_run):
    """The decode record's thread census (services/bench/threads.py): both processes, by name, per timed token; in
    the bench process no thread of the monitor's where the kernel keeps the cgroup's peak (or there is no cgroup) and
    there is no GPU: the timed decode's only Python thread beside the session stream's reader is its own."""
    _, r, _ = bench_run
    d = next(c["decode"] for c in r["cases"] if c.get("decode", {}).get("tokens"))
    w, s = d["threads"]["worker"], d["threads"]["store"]
    assert w["ended"] == 0 and w["seconds"] > 0 and "threads" in s
    main = w["threads"]["MainThread"]
    assert main["python"] is True and main["threads"] == 1 and main["cpu_us"] > 0
    assert r["memory"].get("peak_by") in ("kernel", None)
    py = {k for k, v in w["threads"].items() if v.get("python")}
    assert "bench-monitor" not in w["threads"] and py <= {"MainThread", "store-session-seq"}, py
