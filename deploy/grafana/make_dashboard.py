"""Generates deploy/grafana/dashboards/betelgeuse.json, the Grafana dashboard (source of truth).

    python deploy/grafana/make_dashboard.py          # rewrite the JSON
    python deploy/grafana/make_dashboard.py --check  # exit 1 if the committed JSON is stale

Edit the panels here, never the JSON. tests/services/test_dashboards.py checks that the committed JSON is
current, that every expression parses (promtool) and uses only metrics defined in
betelgeuse/metrics.py, and that every panel returns data from a real Prometheus.
Grafana 10+; the data source is a variable (uid "prometheus" when provisioned from provisioning/).
Variables $job, $instance and $model filter every query (model is the target label the ServiceMonitor
or prometheus.yml sets; "All" also matches series without it); the speed, tier-share, disk-wait,
error and memory panels read the recording rules of deploy/prometheus/rules/betelgeuse.rules.yml.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "betelgeuse.json"
RI = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}
PREFILL, DECODE, VRAM = 'phase="prefill"', 'phase="decode"', 'tier="vram"'
USED, CURRENT, KMAX = 'state="used"', 'kind="current"', 'kind="max"'
FAILED = 'code!~"OK|CANCELLED"'  # client cancellations are not server errors
VARS = 'job=~"$job", instance=~"$instance", model=~"$model"'   # every selector carries these


def s(metric: str, sel: str = "") -> str:
    """metric{the variables, sel}"""
    return f"{metric}{{{VARS}{', ' + sel if sel else ''}}}"


def rate(metric: str, by: str = "", sel: str = "") -> str:
    grp = f" by ({by})" if by else ""
    return f"sum{grp} (rate({s(metric, sel)}[{RI}]))"


def quantile(q: float, hist: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({s(hist + '_bucket')}[{RI}])))"


def rule(name: str, sel: str = "") -> str:
    """A recording rule of deploy/prometheus/rules/betelgeuse.rules.yml, filtered by the variables."""
    return s(name, sel)


PP_RULE = "instance:betelgeuse_prefill_tokens_per_second:rate1m"
TG_RULE = "instance:betelgeuse_decode_tokens_per_second:rate1m"
PP = f"avg ({rule(PP_RULE)})"
TG = f"avg ({rule(TG_RULE)})"
HOST_MEM = 'host:betelgeuse_cgroup_memory_used:ratio{model=~"$model"}'

# (row title, [(kind, title, unit, [(expr, legend)], description)])
ROWS = [
    ("Throughput", [
        ("stat", "PP tok/s", "short", [(PP, "prefill")],
         "Prompt tokens per second of prefill time (mean over the selected replicas)."),
        ("stat", "TG tok/s", "short", [(TG, "decode")],
         "Generated tokens per second of decode time (mean over the selected replicas)."),
        ("stat", "TTFT p50", "s", [(quantile(0.5, "betelgeuse_time_to_first_token_seconds"), "p50")], ""),
        ("stat", "VRAM hit ratio", "percentunit",
         [(f"{rate('betelgeuse_expert_reads_total', sel=VRAM)} / {rate('betelgeuse_expert_reads_total')}",
           "vram")], "Share of expert loads served from VRAM hot slots."),
        ("timeseries", "PP and TG speed", "short",
         [(rule(PP_RULE), "PP {{instance}}"), (rule(TG_RULE), "TG {{instance}}")],
         "rate(tokens) / rate(busy seconds of that phase), per replica (recording rules)."),
        ("timeseries", "Tokens per second (wall)", "short",
         [(rate("betelgeuse_prompt_tokens_total"), "prompt"), (rate("betelgeuse_generation_tokens_total"), "generated")],
         ""),
        ("timeseries", "Engine busy share by phase", "percentunit",
         [(rate("betelgeuse_engine_busy_seconds_total", by="phase"), "{{phase}}")], ""),
    ]),
    ("Latency", [
        ("timeseries", "Time to first token", "s",
         [(quantile(q, "betelgeuse_time_to_first_token_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95)], ""),
        ("timeseries", "Inter-token latency", "s",
         [(quantile(q, "betelgeuse_inter_token_latency_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95)], ""),
        ("timeseries", "End-to-end request latency", "s",
         [(quantile(q, "betelgeuse_request_duration_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95)]
         + [(quantile(0.95, "betelgeuse_request_queue_seconds"), "queue p95")], ""),
        ("heatmap", "TTFT distribution", "s",
         [(f"sum by (le) (increase({s('betelgeuse_time_to_first_token_seconds_bucket')}[{RI}]))", "{{le}}")], ""),
    ]),
    ("Experts", [
        ("timeseries", "Expert reads per tier", "short",
         [(f"sum by (tier) ({rule('instance:betelgeuse_expert_reads:rate1m')})", "{{tier}}")],
         "Expert loads per second by source tier."),
        ("timeseries", "Hit ratio per tier", "percentunit",
         [(rule("instance:betelgeuse_expert_reads_ratio:rate5m"), "{{tier}} {{instance}}")],
         "Share of expert loads per tier over 5 minutes, per replica."),
        ("timeseries", "Expert slots used per tier", "short",
         [(f"sum by (tier) ({s('betelgeuse_expert_slots', USED)})", "{{tier}} used"),
          (f"sum by (tier) ({s('betelgeuse_expert_slots')})", "{{tier}} total")], ""),
        ("timeseries", "Host-slot churn", "short",
         [(rate("betelgeuse_expert_loads_total", by="reason"), "loads {{reason}}"),
          (rate("betelgeuse_expert_evictions_total"), "evictions")], ""),
    ]),
    ("Disk and PCIe", [
        ("timeseries", "Disk read bytes/s", "Bps",
         [(rate("betelgeuse_disk_read_bytes_total", by="reason"), "{{reason}}")], "Reads by the store (O_DIRECT)."),
        ("timeseries", "Disk wait share of busy time", "percentunit",
         [(rule("instance:betelgeuse_disk_wait_share:rate5m"), "{{phase}} {{instance}}")],
         "Time compute stalled on disk-resident experts (5 minutes, per replica; alert: BetelgeuseDiskWaitHigh)."),
        ("timeseries", "Disk busy share", "percentunit",
         [(rate("betelgeuse_disk_active_seconds_total"), "{{instance}}")],
         "Wall time with a store read in flight; what is left to 100% the disk stood idle (decode's gap to its disk "
         "bound when reads are issued late)."),
        ("timeseries", "Disk read latency", "s",
         [(quantile(q, "betelgeuse_disk_read_duration_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.99)], ""),
        ("timeseries", "Host to device bytes/s", "Bps",
         [(rate("betelgeuse_host_to_device_bytes_total"), "h2d"),
          (f"{rate('betelgeuse_host_to_device_bytes_total')} / {rate('betelgeuse_host_to_device_seconds_total')}",
           "effective bandwidth")], ""),
        ("stat", "O_DIRECT reads", "short", [(f"min({s('betelgeuse_disk_direct_io')})", "direct")],
         "1 = page cache bypassed; 0 = buffered fallback (tmpfs, overlay)."),
    ]),
    ("Memory", [
        ("timeseries", "cgroup memory against the limit", "bytes",
         [(s("betelgeuse_cgroup_memory_bytes", 'kind="current"'), "{{job}} {{instance}}"),
          (f"sum({s('betelgeuse_cgroup_memory_bytes', CURRENT)})", "both"),
          (f"max({s('betelgeuse_cgroup_memory_bytes', KMAX)})", "memory.max")], ""),
        ("timeseries", "cgroup memory share per replica", "percentunit",
         [(HOST_MEM, "{{host}}")], "Both processes of a replica against its limit (alert: BetelgeuseMemoryNearLimit)."),
        ("timeseries", "VRAM in use", "bytes",
         [(f"sum by (pool) ({s('betelgeuse_vram_used_bytes')})", "{{pool}}"),
          (f"max({s('betelgeuse_vram_budget_bytes')})", "budget")], ""),
        ("timeseries", "Resident memory per process", "bytes",
         [(s("process_resident_memory_bytes", 'job=~"betelgeuse-.*"'), "{{job}} {{instance}} RSS"),
          (f"max({s('betelgeuse_arena_bytes')})", "host-slot arena")], ""),
    ]),
    ("Requests", [
        ("timeseries", "Request rate by status code", "reqps",
         [(rate("betelgeuse_requests_total", by="code"), "{{code}}")], ""),
        ("timeseries", "Error ratio", "percentunit",
         [(rule("instance:betelgeuse_requests_error_ratio:rate5m"), "{{instance}}")],
         "Failed RPCs (not OK, not cancelled by the client) over all RPCs, 5 minutes (alert: BetelgeuseErrorRate)."),
        ("timeseries", "Running and waiting", "short",
         [(f"sum({s('betelgeuse_requests_running')})", "running"),
          (f"sum({s('betelgeuse_requests_waiting')})", "waiting")], ""),
        ("timeseries", "Finished generations by reason", "short",
         [(rate("betelgeuse_requests_finished_total", by="finish_reason"), "{{finish_reason}}")], ""),
        ("stat", "Ready", "short", [(f"min by (job) ({s('betelgeuse_ready')})", "{{job}}")], "1 = serving."),
    ]),
]


def panel(pid: int, kind: str, title: str, unit: str, targets, desc: str, x: int, y: int, w: int, h: int) -> dict:
    p = {
        "id": pid, "type": kind, "title": title, "description": desc, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": e, "legendFormat": lg,
                     **({"format": "heatmap"} if kind == "heatmap" else {})}
                    for i, (e, lg) in enumerate(targets)],
    }
    if kind == "stat":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area"}
    elif kind == "timeseries":
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
    elif kind == "heatmap":
        p["options"] = {"calculate": False, "yAxis": {"unit": unit}}
    return p


def variable(name: str, label: str, query: str) -> dict:
    """A multi-value query variable; All = the regex .*, which also matches series without the label."""
    return {"name": name, "label": label, "type": "query", "datasource": DS, "definition": query,
            "query": {"query": query, "refId": f"var-{name}"}, "refresh": 2, "multi": True, "includeAll": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1, "hide": 0}


VARIABLES = ("job", "instance", "model")


def build() -> dict:
    panels, pid, y = [], 1, 0
    for title, items in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}})
        pid, y, x, prev_h = pid + 1, y + 1, 0, 0
        for kind, ptitle, unit, targets, desc in items:
            w, h = (6, 4) if kind == "stat" else (12, 8)
            if x + w > 24:
                x, y = 0, y + prev_h
            panels.append(panel(pid, kind, ptitle, unit, targets, desc, x, y, w, h))
            pid, x, prev_h = pid + 1, x + w, h
        y += prev_h
    return {
        "id": None, "uid": "betelgeuse-overview", "title": "Betelgeuse", "tags": ["betelgeuse"],
        "description": "Out-of-core MoE inference: PP/TG speed, latency, expert tiers, disk and PCIe, memory.",
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "",
        "templating": {"list": [{"name": "datasource", "label": "Data source", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0},
                                variable("job", "Job", "label_values(betelgeuse_build_info, job)"),
                                variable("instance", "Instance", 'label_values(betelgeuse_build_info{job=~"$job"}, instance)'),
                                variable("model", "Model", "label_values(betelgeuse_build_info, model)")]},
        "annotations": {"list": []}, "links": [], "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every query, rows' nested panels included."""
    out = []
    for p in dashboard["panels"]:
        for q in [p] + p.get("panels", []):
            out += [(q["title"], t["expr"]) for t in q.get("targets", [])]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python deploy/grafana/make_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
