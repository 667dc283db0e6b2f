"""A real Prometheus (/usr/bin/prometheus) scrapes the real store and worker processes while clients
generate, with the deploy/ recording rules loaded: every query of every Grafana panel and every
recording rule returns data, and what Prometheus stored equals what the processes' /metrics say."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict
from pathlib import Path

import grpc
import pytest
import yaml

try:
    from tests import promtest
    from tests import service_helpers as h
except ImportError:  # tests/ itself is on sys.path
    import promtest
    import service_helpers as h

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "betelgeuse.rules.yml"
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "betelgeuse.json"

service_model = h.service_model   # the session fixture, under its name in this module
pytestmark = pytest.mark.skipif(not promtest.available(),
                                reason="/usr/bin/prometheus missing (apt-get install prometheus)")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, read from the JSON Grafana loads."""
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for t in p.get("targets", []):
            if t.get("expr"):
                out.append((p["title"], t["expr"]))
    return out


def concrete(expr: str) -> str:
    """As Grafana sends it: the dashboard's variables at All (.*), $__rate_interval at 1m."""
    for var in ("job", "instance", "model"):
        expr = expr.replace(f"${var}", ".*")
    return expr.replace("$__rate_interval", "1m")


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def traffic(address: str, stop: threading.Event, counts: dict):
    """What agents do: text, chat and token-id prompts, a bad request, a cancelled stream; over and over."""
    with grpc.insecure_channel(address) as ch:
        s = h.stub(ch)
        i = 0
        while not stop.is_set():
            reqs = [h.request(text=f"The river ran low {i}", max_tokens=6, ignore_eos=True),
                    h.request(messages=[{"role": "user", "content": f"Name {i} rivers."}], max_tokens=4),
                    h.request(ids=[3, 4, 5, 6 + i % 100], max_tokens=5, ignore_eos=True)]
            for r in reqs:
                got = h.run_stream(s.Generate(r, timeout=60))
                counts["ok" if got.code is None else str(got.code)] += 1
            bad = h.run_stream(s.Generate(h.request(text="x", temperature=-1), timeout=10))
            counts[str(bad.code)] += 1
            call = s.Generate(h.request(text="cancel me", max_tokens=500, ignore_eos=True), timeout=60)
            got = h.run_stream(call, on_token=lambda st: call.cancel())
            counts[str(got.code)] += 1
            i += 1


def finite(result: list[dict]) -> bool:
    vals = [float(r["value"][1]) for r in result if "value" in r]
    return bool(vals) and all(not math.isnan(v) for v in vals)


def test_every_panel_and_rule_returns_data(service_model, tmp_path):
    c = h.start_cluster(service_model, tmp_path / "run")
    jobs = [j["job_name"] for j in yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]]
    assert jobs == ["betelgeuse-worker", "betelgeuse-store"]
    targets = {"betelgeuse-worker": [c.worker_metrics_url.split("/")[2]],
               "betelgeuse-store": [c.store_metrics_url.split("/")[2]]}
    stop = threading.Event()
    counts = defaultdict(int)
    feeder = threading.Thread(target=traffic, args=(c.address, stop, counts), daemon=True)
    try:
        with promtest.Prometheus(targets, tmp_path / "prom", rule_files=[RULES]) as prom:
            prom.wait_for_targets_up()
            feeder.start()
            prom.wait_for_samples("betelgeuse_prompt_tokens_total", n=4)
            prom.wait_for_samples("betelgeuse_disk_read_bytes_total", n=4)
            # rate() needs two samples that differ inside the window: wait until generation shows in both jobs
            t0 = time.monotonic()
            while not (finite(prom.query("sum(rate(betelgeuse_generation_tokens_total[1m])) > 0")["result"]) and
                       finite(prom.query("sum(rate(betelgeuse_disk_read_bytes_total[1m])) > 0")["result"])):
                assert time.monotonic() - t0 < 30, "no generation traffic reached Prometheus"
                time.sleep(0.3)
            assert counts["ok"] > 0 and counts[str(grpc.StatusCode.INVALID_ARGUMENT)] > 0, dict(counts)
            empty, nan = [], []
            for r in rules():                         # panels read the recording rules
                prom.wait_for_rule(r["record"])
            for title, expr in dashboard_exprs():
                res = prom.query(concrete(expr))
                assert res["resultType"] == "vector", (title, res["resultType"])
                if not res["result"]:
                    empty.append(f"{title}: {expr}")
                elif not finite(res["result"]):
                    nan.append(f"{title}: {expr}")
            for r in rules():
                prom.wait_for_rule(r["record"])
                if not finite(prom.query(r["record"])["result"]):
                    nan.append(f"rule {r['record']}")
            pp_expr = concrete(dict(dashboard_exprs())["PP tok/s"])
            pp = float(prom.query(pp_expr)["result"][0]["value"][1])
            print(f"\npanel 'PP tok/s': {pp_expr}\n  -> {pp:.1f} tok/s (tiny model, CPU, {dict(counts)})")
            assert pp > 0
            if nan:
                print("panels whose query returned NaN (no observations in the window):\n  " + "\n  ".join(nan))
            assert not empty, "panels without data:\n" + "\n".join(empty)
            # kind="max" is NaN where no memory.max applies (the processes report "unlimited" as NaN); under
            # the slice's MemoryMax=12G it is a number. Nothing else may be NaN.
            from betelgeuse.store.cgroup import CgroupMemory
            cg = CgroupMemory.of_process()
            if cg is None or cg.limit() is None:
                nan = [x for x in nan if 'kind="max"' not in x and "cgroup_memory_used" not in x]
            assert not nan, "panels returning NaN:\n" + "\n".join(nan)

            # once quiet, Prometheus holds exactly what the processes serve
            stop.set()
            feeder.join(60)
            time.sleep(0.7)                           # the store copies its counters every 0.5 s
            direct_w, direct_s = h.scrape(c.worker_metrics_url), h.scrape(c.store_metrics_url)
            t_quiet = time.time()
            time.sleep(2.5)                           # at least one scrape after the last change
            for name, direct, labels in (("betelgeuse_prompt_tokens_total", direct_w, {}),
                                         ("betelgeuse_generation_tokens_total", direct_w, {}),
                                         ("betelgeuse_expert_reads_total", direct_w, {"tier": "disk"}),
                                         ("betelgeuse_requests_total", direct_w, {"code": "INVALID_ARGUMENT"}),
                                         ("betelgeuse_disk_read_bytes_total", direct_s, {})):
                sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
                got = prom.query(f"sum({name}{{{sel}}})", at=t_quiet + 2.0)["result"]
                assert float(got[0]["value"][1]) == h.value(direct, name, **labels) > 0, name
    finally:
        stop.set()
        if feeder.is_alive():
            feeder.join(60)
        c.stop()
