"""`betelgeuse bench --suite agents` at a tiny geometry on the CPU: the real LLMEngine against a real store
process (in the bench's cgroup where the machine allows one) runs the agent loop with the prefix cache off and
on and 1 / 2 / 8 concurrent clients within its time budget, and writes a well-formed bench.json / bench.md whose
figures are consistent. No performance targets: those are judged on the GPU (docs/benchmarks/README.md)."""

from __future__ import annotations

import json
import os

import pytest

from service_helpers import bench_cli

BUDGET = 60.0
TURNS, TURN_TOKENS, REPEAT, CLIENT_TOKENS = 4, 4, 130, 6
CLIENTS = (1, 2, 8)


def _bench(*args, timeout=BUDGET + 90):
    return bench_cli("agents", *args, timeout=timeout)


@pytest.fixture(scope="module")
def agents_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("agents")
    out = work / "out"
    p = _bench("--quick", "--preset", "tiny", "--layers", "2", "--slots", "2+6", "--memory-max", "4G",
               "--turns", str(TURNS), "--agent-prompts", "48,200", "--system-tokens", "16",
               "--turn-tokens", str(TURN_TOKENS), "--repeat-prompt", str(REPEAT),
               "--clients", ",".join(map(str, CLIENTS)), "--client-prompt", "8,16", "--client-tokens", str(CLIENT_TOKENS),
               "--warm-prompt", "16", "--warm-tokens", "2", "--prefill-chunk", "16", "--time-budget", str(BUDGET),
               "--work-dir", str(work), "--out", str(out), "--run-name", "agents-smoke")
    assert p.returncode == 0, p.stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text()), p


def test_runs_every_case_within_budget(agents_run):
    out, r, p = agents_run
    assert r["suite"] == "agents" and r["status"] == "complete" and r["errors"] == [] and r["skipped"] == []
    assert r["elapsed_s"] < BUDGET + 15, r["elapsed_s"]
    assert r["command"].startswith("betelgeuse bench --suite agents")
    names = [c["name"] for c in r["cases"]]
    assert names == ["agent loop, prefix cache off", "agent loop, prefix cache on", "1 client", "8 clients", "2 clients"]
    for c in r["cases"]:
        assert c["store_exit"] == 0, c.get("store_error")
        assert c["arena_mappings_after_close"] == 0, c["name"]         # the old arena never lingers
        assert c["runners_alive_after"] == 0, c["name"]                # nor the old runner (its VRAM, its RAM)
        assert c["plan"]["n_vram"] == 2 and c["plan"]["n_host"] == 6
    assert "## Judged figures" in p.stdout and "Aggregate decode 8 clients / 1 client" in p.stdout


def test_agent_loop_resends_the_conversation(agents_run):
    _, r, _ = agents_run
    users = r["options"]["user_tokens_per_turn"]
    off, on = r["cases"][0], r["cases"][1]
    assert off["prefix_cache_bytes"] == 0 and on["prefix_cache_bytes"] == "auto"
    assert off["engine_config"]["max_running"] == on["engine_config"]["max_running"] == 1
    assert off["engine_config"]["prefill_chunk"] == 16             # prefix-cache blocks of 16: every turn can hit
    for c in (off, on):
        turns = c["turns"]
        assert len(turns) == TURNS
        assert turns[0]["prompt_tokens"] == 48
        for k in range(1, TURNS):     # previous prompt + previous completion + the new user ids
            assert turns[k]["prompt_tokens"] == turns[k - 1]["prompt_tokens"] + TURN_TOKENS + users[k]
        for t in turns:
            assert t["finish_reason"] == "length" and t["completion_tokens"] == TURN_TOKENS
            assert 0 < t["ttft_s"] < 30 and len(t["token_s"]) == TURN_TOKENS
            assert t["token_s"] == sorted(t["token_s"]) and t["token_s"][0] == pytest.approx(t["ttft_s"], abs=1e-5)
            assert t["usage"]["prompt_n"] == t["prompt_tokens"]
        assert 180 <= turns[-1]["prompt_tokens"] <= 220
        assert [x["prompt_tokens"] for x in c["repeat"]] == [REPEAT, REPEAT, REPEAT + 1]
    # greedy: the prefix cache (when there is one) must not change a single token
    assert r["summary"]["agent_same_tokens"] is True
    assert [t["tokens"] for t in off["turns"]] == [t["tokens"] for t in on["turns"]]
    assert off["repeat"][0]["tokens"] == on["repeat"][0]["tokens"] == on["repeat"][1]["tokens"]
    assert all(t["cached_tokens"] == 0 for t in off["turns"] + off["repeat"])     # cache off: nothing reused
    s = r["summary"]
    assert s["agent_cache_off"]["ratio_last_first"] == pytest.approx(off["turns"][-1]["ttft_s"] / off["turns"][0]["ttft_s"])
    if not on["prefix_cache"]["engine_has_prefix_cache"]:
        assert all(t["cached_tokens"] == 0 for t in on["turns"] + on["repeat"])
        pytest.skip("the engine has no prefix cache yet: cached tokens are 0")
    # the second submission of the same prompt is served whole from the cache (no pass); the same prompt + 1 token
    # reuses its whole blocks and computes the rest (the last token always: it gives the logits)
    assert on["repeat"][1]["cached_tokens"] == REPEAT
    assert 0 < on["repeat"][2]["cached_tokens"] < REPEAT + 1
    assert s["agent_cache_on"]["repeat_plus1_cached"] == on["repeat"][2]["cached_tokens"]
    assert all(t["cached_tokens"] > 0 for t in on["turns"][1:])                   # every later turn hits
    assert all(t["cached_tokens"] < t["prompt_tokens"] for t in on["turns"])            # new tokens every turn


def test_concurrency_figures_consistent(agents_run):
    _, r, _ = agents_run
    conc = {c["clients"]: c for c in r["cases"] if c["kind"] == "concurrency"}
    assert sorted(conc) == sorted(CLIENTS)
    for n, c in conc.items():
        f = c["figures"]
        assert c["engine_config"]["max_running"] == n                  # >= the clients: every one runs at once
        assert f["completed"] == n and f["completion_tokens"] == n * CLIENT_TOKENS
        assert len(c["requests"]) == n and len({tuple(x["tokens"]) for x in c["requests"]}) >= 1
        assert f["aggregate_decode_tps"] > 0 and f["end_to_end_tps"] > 0 and f["tg_mean"] > 0
        assert 0 < f["ttft_p50_s"] <= f["ttft_p99_s"] <= f["ttft_max_s"]
        assert 0 < f["window_tokens"] <= n * (CLIENT_TOKENS - 1)
        dec = c["passes"]["decode"]
        if set(c["passes"]) <= {"prefill", "decode"}:                 # (no mixed prefill+decode pass kind)
            assert dec["tokens"] == n * (CLIENT_TOKENS - 1)           # every token after the first, once
        assert 1 <= dec["mean_batch"] <= n
        assert dec["reads"]["vram"] + dec["reads"]["host"] + dec["reads"]["disk"] == dec["loads"] > 0
        assert 0 <= dec["disk_share"] <= 1
        assert 0 <= dec["open_ms_max"] <= dec["open_ms"] <= dec["passes"] * dec["pass_ms_mean"]
    one, eight = conc[1]["passes"]["decode"], conc[8]["passes"]["decode"]
    assert one["mean_batch"] == 1 and eight["mean_batch"] > 1          # the 8 sequences decoded in shared passes
    # a shared pass loads the union of the sequences' experts: more per pass, fewer per token
    assert eight["loads_per_pass"] > one["loads_per_pass"] and eight["loads_per_token"] < one["loads_per_token"]
    f1 = conc[1]["figures"]
    assert f1["aggregate_decode_tps"] == pytest.approx(f1["tg_mean"])  # one client: the same figure
    assert r["summary"]["aggregate_8_over_1"] == pytest.approx(conc[8]["figures"]["aggregate_decode_tps"]
                                                               / f1["aggregate_decode_tps"])
    # the disk ceiling, sampled before each case: tokens per pass over the pass's disk bytes at that rate
    for n, c in conc.items():
        s = r["summary"]["concurrency"][str(n)]
        d = c["passes"]["decode"]
        assert c["disk_bps"] > 0 and s["disk_bps"] == c["disk_bps"]
        # both patterns sampled; the bound's rate the faster (max(random, layer))
        assert c["disk_bps"] == max(c["disk_bps_random"], c["disk_bps_layer"]) and min(c["disk_bps_random"], c["disk_bps_layer"]) > 0
        want = d["mean_batch"] * c["disk_bps"] / d["disk_bytes_per_pass"] if d["disk_bytes_per_pass"] else None
        assert s["decode_disk_bound_tps"] == (pytest.approx(want) if want else None)


def test_cgroup_and_markdown(agents_run):
    out, r, _ = agents_run
    md = (out / "bench.md").read_text()
    for section in ("## Judged figures", "## Agent loop", "## Concurrency", "## Expert loads per decode pass", "## Budgets"):
        assert section in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    assert len(rows) == TURNS + 2 * len(CLIENTS)         # a row per turn, per client count in two tables
    mem = r["memory"]
    if mem.get("cgroup") is None:
        pytest.skip(f"no memory cgroup on this machine: {mem.get('reason')}")
    assert mem["limit"] == 4 << 30 and mem["oom_kills"] == 0
    for c in r["cases"]:
        assert c["cgroups"]["store"] == c["cgroups"]["worker"] == mem["cgroup"]
    assert not os.path.exists(mem["cgroup"])


@pytest.mark.parametrize("args, msg", [(["--clients", "0"], "--clients"), (["--agent-prompts", "300,100"], "--agent-prompts"),
                                       (["--turns", "1"], "--turns"), (["--slots", "2+6,auto"], "one slot configuration"),
                                       (["--agent-prompts", "50,100", "--system-tokens", "60"], "system prompt")])
def test_bad_options_refused(tmp_path, args, msg):
    p = _bench("--quick", "--preset", "tiny", "--work-dir", str(tmp_path), *args, timeout=60)
    assert p.returncode != 0 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not list(tmp_path.glob("*.gguf"))              # refused before any model is written


def test_concurrency_only(tmp_path):
    """--no-agent-loop: the concurrency cases alone (the agent-loop cases are listed as skipped, with the reason);
    the report still renders, without agent-loop figures."""
    out = tmp_path / "out"
    p = _bench("--quick", "--preset", "tiny", "--layers", "2", "--slots", "2+6", "--memory-max", "4G", "--no-agent-loop",
               "--clients", "1", "--client-prompt", "8,16", "--client-tokens", "4", "--warm-prompt", "16",
               "--warm-tokens", "2", "--time-budget", "40", "--work-dir", str(tmp_path), "--out", str(out),
               "--run-name", "agents-conc")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((out / "bench.json").read_text())
    assert [c["name"] for c in r["cases"]] == ["1 client"] and r["errors"] == []
    assert [s["case"] for s in r["skipped"]] == ["agent loop, prefix cache off", "agent loop, prefix cache on"]
    assert {s["reason"] for s in r["skipped"]} == {"--no-agent-loop"}
    assert r["cases"][0]["figures"]["completed"] == 1 and "## Concurrency" in (out / "bench.md").read_text()


def test_requests_cut_mid_stream_still_count():
    """A request that fails (or is cut by its deadline) after some tokens keeps its timings and does not break the
    figures (gpu-agents8: a KeyError on 'ttft_s' lost the whole 8-client case); one that got no token is left out."""
    from betelgeuse.api import TokenEvent
    from betelgeuse.errors import BetelgeuseError
    from services.bench.agents import concurrency_figures, run_request

    class Cut:                                   # an engine whose stream yields 3 tokens, then fails
        def submit(self, req, deadline=None):
            def stream():
                for i in range(3):
                    yield TokenEvent(token_id=7 + i, text="", index=i)
                raise BetelgeuseError("deadline exceeded")
            return stream()

    rec = run_request(Cut(), [5, 6], 8, None)
    assert rec["error"].endswith("deadline exceeded") and rec["completion_tokens"] == 3 and rec["ttft_s"] > 0
    f = concurrency_figures([rec, {"t_submit": rec["t_submit"], "times": [], "error": "x", "ttft_s": None}])
    assert f["clients"] == 2 and f["completion_tokens"] == 3 and f["completed"] == 0 and f["ttft_p50_s"] > 0
    assert concurrency_figures([{"error": "x", "times": []}]) == {"completed": 0, "clients": 1, "errors": 1}
