"""`betelgeuse bench --suite serve` on the CPU at the tiny geometry: it starts the real `betelgeuse serve` (both
processes; in a memory cgroup of its own where the machine allows one), drives it over the OpenAI HTTP API with its
own client and writes the issue-24 table (bench.json / bench.md) with consistent figures, for the default `auto`
plan and a fixed 2+6 one. No performance targets: those are judged on the GPU (deploy/device/bench_serve.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUDGET = 90.0         # an upper bound: the run takes ~30 s


def _bench(*args, timeout=BUDGET + 60):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "services.bench.cli", "--suite", "serve", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-bench")
    out = work / "out"
    p = _bench("--quick", "--config", "auto,2+6", "--prefill-chunk", "16", "--time-budget", str(BUDGET),
               "--work-dir", str(work), "--out", str(out), "--run-name", "serve-smoke")
    assert p.returncode == 0, p.stderr[-3000:]
    return work, out, json.loads((out / "bench.json").read_text()), p


def test_the_live_service_gives_the_table(serve_run):
    work, out, r, p = serve_run
    assert r["suite"] == "serve" and r["status"] == "complete" and r["errors"] == [] and r["skipped"] == []
    assert r["command"].startswith("betelgeuse bench --suite serve") and r["elapsed_s"] < BUDGET
    assert r["disk"]["bps"] > 0 and r["disk"]["bytes"] > 0
    assert [c["name"] for c in r["cases"]] == ["auto", "2+6"]
    for c in r["cases"]:
        assert c["serve_exit"] == 0 and not c.get("errors") and not c.get("skipped"), c
        assert c["serve_command"].startswith("betelgeuse serve ") and "--http 127.0.0.1:" in c["serve_command"]
        # the budgets: a cgroup of its own (memory.max 4G, no swap) where the machine allows one, else why not
        mem = c["memory"]
        if mem["cgroup"]:
            assert mem["limit"] == 4 << 30 and 0 < mem["peak"] < 4 << 30 and mem["oom_kills"] == 0
            assert (c["plan"]["memory_limit_bytes"], c["plan"]["memory_limit_source"]) == (4 << 30, "cgroup memory.max")
        else:
            assert mem["reason"] and "--memory-max" in c["serve_command"]
        cold, again = c["cold"], c["again"]
        assert cold["completion_tokens"] == again["completion_tokens"] == 8
        assert 0 < cold["ttft_s"] < 30 and cold["tg"] > 0 and again["tg"] > 0
        assert again["cached_tokens"] >= 16 and cold["cached_tokens"] == 0     # the prefix cache, whole 16-token blocks
        assert again["text"] == cold["text"] != ""                              # greedy: the cache changes no token
        for n in ("1", "2"):
            f = c["clients"][n]["figures"]
            assert f["completed"] == f["clients"] == int(n) and f["aggregate_decode_tps"] > 0, f
            assert f["disk_bound_tps"] > 0 and 0 < f["ttft_p50_s"] <= f["ttft_max_s"] < 30
            assert all(x["completion_tokens"] == 6 and x["prompt_tokens"] == 16 for x in c["clients"][n]["requests"])
        turns = c["agent"]
        assert [t["prompt_tokens"] for t in turns][0] == 40 and len(turns) == 3
        assert all(a["prompt_tokens"] < b["prompt_tokens"] for a, b in zip(turns, turns[1:]))
        assert turns[-1]["cached_tokens"] >= 32                                # the conversation so far, from the cache
        s = r["summary"][c["name"]]
        assert s["aggregate_over_1"]["1"] == 1.0 and s["aggregate_over_1"]["2"] > 0
        assert s["ttft_p50_most_over_lone"] > 0 and s["most_clients"] == 2
    auto, fixed = r["cases"]
    assert (auto["plan"]["vram_slots_requested"], auto["plan"]["host_slots_requested"]) == ("auto", "auto")
    assert (fixed["plan"]["vram_slots"], fixed["plan"]["host_slots"]) == (2, 6)
    assert "--vram-slots auto --host-slots auto" in auto["serve_command"]
    md = (out / "bench.md").read_text()
    for want in ("## The service", "| `auto` | `2+6` |", "| one 32-token prompt: TTFT / TG over 8 tokens |",
                 "| 2 clients (16-token prompts, 6 tokens each)", "disk bound", "agent loop, 3 turns",
                 "TTFT p50, 2 clients together ÷ the lone cold prompt", "## Definitions"):
        assert want in md, want
    assert "## The service" in p.stdout                               # the figures, printed
    assert sorted(x.name for x in out.glob("serve-*.log")) == ["serve-0-auto.log", "serve-1-2_6.log"]
    # nothing left running from this run
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert left == [], left


@pytest.mark.parametrize("args,words", [
    (["--config", "5x"], "--config: '5x' is none of shipped, auto, V+H"),
    (["--serve-args", "--no-such-flag 1"], "--serve-args: serve does not accept"),
    (["--clients", "0"], "--clients: expected positive integers"),
])
def test_bad_options_are_one_line_before_any_work(tmp_path, args, words):
    p = _bench("--quick", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), *args, timeout=60)
    assert p.returncode != 0 and words in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not list((tmp_path / "w").glob("*.gguf"))                 # refused before the model is written
