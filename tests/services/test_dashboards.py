"""Grafana dashboard and Prometheus rules: the JSON is the generator's output, every PromQL expression
parses (promtool), names only metrics defined in betelgeuse/metrics.py, and returns data from a real
Prometheus scraping both metric registries on loopback."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from betelgeuse import metrics as bm
try:
    from tests import promtest
except ImportError:  # pytest run from elsewhere: tests/ itself is on sys.path
    import promtest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "betelgeuse.rules.yml"
ALERTS = DEPLOY / "prometheus" / "rules" / "betelgeuse.alerts.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "betelgeuse.json"
PROMTOOL = shutil.which("promtool")

sys.path.insert(0, str(DEPLOY / "grafana"))
import make_dashboard  # noqa: E402

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")


def dashboard_exprs() -> list[tuple[str, str]]:
    return make_dashboard.expressions(json.loads(DASHBOARD.read_text()))


def rules(path: Path = RULES) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def concrete(expr: str, rate_interval: str = "1m") -> str:
    """As Grafana sends it with every variable at All (its allValue, the regex .*)."""
    for var in make_dashboard.VARIABLES:
        expr = expr.replace(f"${var}", ".*")
    return expr.replace("$__rate_interval", rate_interval)


def defined_names() -> set[str]:
    """Every sample name the two registries expose (with _total/_bucket/_sum/_count/_info)."""
    names = set()
    for m in (bm.make_worker_metrics(), bm.make_store_metrics()):
        for fam in m.registry.collect():
            names |= {s.name for s in fam.samples}
    return names


def used_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values are not names
    tokens = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {t for t in tokens if "betelgeuse" in t or t.startswith(("process_", "python_"))}


def test_committed_json_is_generated():
    assert DASHBOARD.read_text() == make_dashboard.render(), "run: python deploy/grafana/make_dashboard.py"
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "betelgeuse-overview" and d["id"] is None
    titles = {t for t, _ in dashboard_exprs()}
    for want in ("PP tok/s", "TG tok/s", "Time to first token", "Expert reads per tier", "Hit ratio per tier",
                 "Disk read bytes/s", "Disk wait share of busy time", "Host to device bytes/s",
                 "cgroup memory against the limit", "Request rate by status code", "Error ratio"):
        assert want in titles, want
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_every_name_is_defined():
    defined = defined_names()
    records = {r["record"] for r in rules()}
    for where, expr in (dashboard_exprs() + [(r["record"], r["expr"]) for r in rules()]
                        + [(r["alert"], r["expr"]) for r in rules(ALERTS)]):
        for name in used_names(expr):
            ok = name in records if ":" in name else name in defined
            assert ok, f"{where}: {name} is not defined in betelgeuse/metrics.py (or the rules)"


def test_name_check_can_fail():
    assert used_names('rate(betelgeuse_nonexistent_total{job=~"betelgeuse-.*"}[1m])') == {"betelgeuse_nonexistent_total"}
    assert "betelgeuse_nonexistent_total" not in defined_names()


@needs_promtool
def test_promtool_checks_config_and_rules():
    for args in (["check", "config", str(PROM_CONFIG)], ["check", "rules", str(RULES)], ["check", "rules", str(ALERTS)]):
        r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_every_dashboard_expression_parses(tmp_path):
    # promtool parses PromQL offline only inside rule files: wrap each expression as a recording rule
    exprs = dashboard_exprs()
    doc = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": concrete(e)}
                                                      for i, (_, e) in enumerate(exprs)]}]}
    f = tmp_path / "dashboard.rules.yml"
    f.write_text(yaml.safe_dump(doc))
    r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in r.stdout
    # and the check can fail
    f.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(a[1m])"}]}]}))
    assert subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True).returncode != 0


def _activity(w: bm.WorkerMetrics, s: bm.StoreMetrics, stop: threading.Event) -> None:
    """Engine-like traffic: counters move between scrapes, histograms fill."""
    w.model_info.info({"name": "tiny", "arch": "qwen3moe", "quant": "Q8_0"})
    w.ready.set(1)
    s.ready.set(1)
    s.disk_direct_io.set(1)
    s.arena_bytes.set(3 << 30)
    w.vram_budget_bytes.set(12 << 30)
    for m in (w, s):
        m.set_cgroup_reader(lambda: 2 << 30, lambda: 12 << 30)
    while not stop.is_set():
        w.prompt_tokens.inc(64)
        w.busy_seconds.labels(phase="prefill").inc(0.05)
        w.generation_tokens.inc(4)
        w.busy_seconds.labels(phase="decode").inc(0.04)
        w.ttft.observe(0.3)
        w.inter_token.observe(0.02)
        w.request_duration.observe(1.5)
        w.request_queue.observe(0.01)
        w.requests.labels(method="Generate", code="OK").inc()
        w.requests.labels(method="Generate", code="INVALID_ARGUMENT").inc()
        w.requests_finished.labels(finish_reason="length").inc()
        for tier, n in (("vram", 5), ("host", 3), ("disk", 2)):
            w.expert_reads.labels(tier=tier, phase="prefill").inc(n)
            w.expert_reads.labels(tier=tier, phase="decode").inc(n)
        w.disk_wait_seconds.labels(phase="prefill").inc(0.01)
        w.disk_wait_seconds.labels(phase="decode").inc(0.01)
        w.h2d_bytes.inc(1 << 24)
        w.h2d_seconds.inc(0.001)
        w.expert_slots.labels(tier="vram", state="used").set(240)
        w.vram_used_bytes.labels(pool="experts").set(9 << 30)
        w.requests_running.set(1)
        s.disk_read_bytes.labels(reason="demand").inc(1 << 22)
        s.disk_reads.labels(reason="demand").inc(2)
        s.disk_read_duration.observe(0.003)
        s.expert_loads.labels(reason="demand").inc(2)
        s.expert_evictions.inc(1)
        s.expert_slots.labels(tier="host", state="used").set(700)
        s.expert_slots.labels(tier="host", state="free").set(20)
        stop.wait(0.2)


@pytest.mark.skipif(not promtest.available(), reason="/usr/bin/prometheus missing (apt-get install prometheus)")
def test_every_panel_returns_data_from_real_prometheus(tmp_path):
    w, s = bm.make_worker_metrics(), bm.make_store_metrics()
    servers = [bm.serve_metrics(m.registry, "127.0.0.1", 0) for m in (w, s)]
    jobs = [j["job_name"] for j in yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]]
    assert jobs == ["betelgeuse-worker", "betelgeuse-store"]
    targets = {job: [f"127.0.0.1:{port}"] for job, (_, port) in zip(jobs, servers)}
    stop = threading.Event()
    feeder = threading.Thread(target=_activity, args=(w, s, stop), daemon=True)
    feeder.start()
    try:
        with promtest.Prometheus(targets, tmp_path / "prom", rule_files=[RULES, ALERTS]) as prom:
            prom.wait_for_targets_up()
            prom.wait_for_samples("betelgeuse_prompt_tokens_total", n=3)
            prom.wait_for_samples("betelgeuse_disk_read_bytes_total", n=3)
            for r in rules():                       # the panels read them
                prom.wait_for_rule(r["record"])
            empty = []
            for title, expr in dashboard_exprs():
                data = prom.query(concrete(expr, "1m"))
                assert data["resultType"] in ("vector", "matrix"), (title, data["resultType"])
                if not data["result"]:
                    empty.append(f"{title}: {expr}")
            assert not empty, "panels without data:\n" + "\n".join(empty)
            # values are the ones fed in, not just present
            ratio = prom.query(concrete(dict(dashboard_exprs())["VRAM hit ratio"]))["result"]
            assert float(ratio[0]["value"][1]) == pytest.approx(0.5, abs=0.05)
            pp = prom.query(concrete(dict(dashboard_exprs())["PP tok/s"]))["result"]
            assert float(pp[0]["value"][1]) == pytest.approx(64 / 0.05, rel=0.05)
            for r in rules():
                prom.wait_for_rule(r["record"])
    finally:
        stop.set()
        feeder.join()
        for srv, _ in servers:
            srv.shutdown()
            srv.server_close()


def test_dashboard_variables_filter_every_query():
    d = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "job", "instance", "model"]
    for v in d["templating"]["list"][1:]:
        assert v["includeAll"] and v["multi"] and v["allValue"] == ".*"
        assert "betelgeuse_build_info" in v["query"]["query"]
    records = {r["record"] for r in rules()}
    for title, expr in dashboard_exprs():
        bare = re.sub(r"\{[^}]*\}", "", expr)
        selectors = re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr)
        names_used = {n for n in used_names(bare)}
        assert names_used, (title, expr)
        filtered = {n for n, sel in selectors if 'model=~"$model"' in sel}
        assert names_used <= filtered, f"{title}: {names_used - filtered} not filtered by $model"
        for n, sel in selectors:
            if not n.startswith("host:"):
                assert 'job=~"$job"' in sel and 'instance=~"$instance"' in sel, (title, n)
    used_rules = {n for _, e in dashboard_exprs() for n in used_names(e) if ":" in n}
    assert len(used_rules) >= 6 and used_rules <= records, used_rules - records


def _series(name: str, values: str, **labels) -> dict:
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{lab}}}", "values": values}


@needs_promtool
def test_alert_rules_fire_when_they_should(tmp_path):
    """`promtool test rules` on synthetic series: each alert fires for the bad replica only, after its `for:`."""
    bad, good = {"job": "betelgeuse-worker", "instance": "10.0.0.1:9464"}, {"job": "betelgeuse-worker",
                                                                               "instance": "10.0.0.2:9464"}
    store_bad, store_good = dict(bad, job="betelgeuse-store", instance="10.0.0.1:9465"), \
        dict(good, job="betelgeuse-store", instance="10.0.0.2:9465")
    G = 2 ** 30
    series = [
        _series("up", "0x40", **store_bad), _series("up", "1x40", **store_good),
        _series("betelgeuse_ready", "0x40", **bad), _series("betelgeuse_ready", "1x40", **good),
        # replica 1: 6 + 5.9 GiB of 12 GiB; replica 2: 4 + 5 GiB
        _series("betelgeuse_cgroup_memory_bytes", f"{6 * G}x40", kind="current", **bad),
        _series("betelgeuse_cgroup_memory_bytes", f"{int(5.9 * G)}x40", kind="current", **store_bad),
        _series("betelgeuse_cgroup_memory_bytes", f"{4 * G}x40", kind="current", **good),
        _series("betelgeuse_cgroup_memory_bytes", f"{5 * G}x40", kind="current", **store_good),
        *[_series("betelgeuse_cgroup_memory_bytes", f"{12 * G}x40", kind="max", **l)
          for l in (bad, store_bad, good, store_good)],
        # decode: 40 s of each 60 s busy second waits for the disk on replica 1, 10 s on replica 2
        _series("betelgeuse_engine_busy_seconds_total", "0+60x40", phase="decode", **bad),
        _series("betelgeuse_disk_wait_seconds_total", "0+40x40", phase="decode", **bad),
        _series("betelgeuse_engine_busy_seconds_total", "0+60x40", phase="decode", **good),
        _series("betelgeuse_disk_wait_seconds_total", "0+10x40", phase="decode", **good),
        # 10% INTERNAL on replica 1; 10% CANCELLED (the client's doing) on replica 2
        _series("betelgeuse_requests_total", "0+90x40", method="Generate", code="OK", **bad),
        _series("betelgeuse_requests_total", "0+10x40", method="Generate", code="INTERNAL", **bad),
        _series("betelgeuse_requests_total", "0+90x40", method="Generate", code="OK", **good),
        _series("betelgeuse_requests_total", "0+10x40", method="Generate", code="CANCELLED", **good),
        _series("betelgeuse_requests_waiting", "3x40", **bad), _series("betelgeuse_requests_waiting", "0x40", **good),
    ]
    alerts = {r["alert"]: r for r in rules(ALERTS)}
    want = {  # alert -> (labels of the one firing alert, minutes after which it fires, $value as a percentage)
        "BetelgeuseDown": (store_bad, 3, None),
        "BetelgeuseNotReady": (bad, 16, None),
        "BetelgeuseMemoryNearLimit": ({"host": "10.0.0.1"}, 11, "99.17%"),   # 11.9 / 12
        "BetelgeuseDiskWaitHigh": (dict(bad, phase="decode"), 21, "66.67%"),  # 40 / 60
        "BetelgeuseErrorRate": (bad, 16, "10%"),
        "BetelgeuseQueueing": (bad, 21, None),
    }

    def render(template: str, labels: dict, value: str | None) -> str:
        out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
        return out.replace("{{ $value | humanizePercentage }}", value or "")
    assert set(want) == set(alerts)
    cases = []
    for name, (labels, at, value) in want.items():
        sev = {"severity": alerts[name]["labels"]["severity"]}
        notes = {k: render(v, labels, value) for k, v in alerts[name]["annotations"].items()}
        assert "{{" not in str(notes), notes
        cases.append({"eval_time": "1m", "alertname": name, "exp_alerts": []})
        cases.append({"eval_time": f"{at}m", "alertname": name,
                      "exp_alerts": [{"exp_labels": {**labels, **sev},
                                      "exp_annotations": notes}]})
    test = {"rule_files": [str(RULES), str(ALERTS)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}]}
    f = tmp_path / "alerts_test.yml"
    f.write_text(yaml.safe_dump(test, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # and the check can fail: the healthy replica is not expected to alert
    cases[-1]["exp_alerts"][0]["exp_labels"]["instance"] = good["instance"]
    f.write_text(yaml.safe_dump(test, sort_keys=False))
    assert subprocess.run([PROMTOOL, "test", "rules", str(f)], capture_output=True, timeout=120).returncode != 0
