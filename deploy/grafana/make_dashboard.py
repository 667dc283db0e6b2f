"""Generates deploy/grafana/dashboards/betelgeuse.json, the Grafana dashboard (source of truth).

    python deploy/grafana/make_dashboard.py          # rewrite the JSON
    python deploy/grafana/make_dashboard.py --check  # exit 1 if the committed JSON is stale

Edit the panels here, never the JSON. tests/test_dashboards.py checks that the committed JSON is
current, that every expression parses (promtool) and uses only metrics defined in
betelgeuse/metrics.py, and that every panel returns data from a real Prometheus.
Grafana 10+; the data source is a variable (uid "prometheus" when provisioned from provisioning/).
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
FAILED = 'code!~"OK|CANCELLED"'  # client cancellations are not server errors


def rate(metric: str, by: str = "", sel: str = "") -> str:
    grp = f" by ({by})" if by else ""
    sel = f"{{{sel}}}" if sel else ""
    return f"sum{grp} (rate({metric}{sel}[{RI}]))"


def quantile(q: float, hist: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({hist}_bucket[{RI}])))"


PP = f"{rate('betelgeuse_prompt_tokens_total')} / {rate('betelgeuse_engine_busy_seconds_total', sel=PREFILL)}"
TG = f"{rate('betelgeuse_generation_tokens_total')} / {rate('betelgeuse_engine_busy_seconds_total', sel=DECODE)}"

# (row title, [(kind, title, unit, [(expr, legend)], description)])
ROWS = [
    ("Throughput", [
        ("stat", "PP tok/s", "short", [(PP, "prefill")], "Prompt tokens per second of prefill time."),
        ("stat", "TG tok/s", "short", [(TG, "decode")], "Generated tokens per second of decode time."),
        ("stat", "TTFT p50", "s", [(quantile(0.5, "betelgeuse_time_to_first_token_seconds"), "p50")], ""),
        ("stat", "VRAM hit ratio", "percentunit",
         [(f"{rate('betelgeuse_expert_reads_total', sel=VRAM)} / {rate('betelgeuse_expert_reads_total')}",
           "vram")], "Share of expert loads served from VRAM hot slots."),
        ("timeseries", "PP and TG speed", "short", [(PP, "PP tok/s"), (TG, "TG tok/s")],
         "rate(tokens) / rate(busy seconds of that phase)."),
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
         [(f"sum by (le) (increase(betelgeuse_time_to_first_token_seconds_bucket[{RI}]))", "{{le}}")], ""),
    ]),
    ("Experts", [
        ("timeseries", "Expert reads per tier", "short",
         [(rate("betelgeuse_expert_reads_total", by="tier"), "{{tier}}")], "Expert loads per second by source tier."),
        ("timeseries", "Hit ratio per tier", "percentunit",
         [(f"{rate('betelgeuse_expert_reads_total', by='tier')} / ignoring (tier) group_left "
           f"{rate('betelgeuse_expert_reads_total')}", "{{tier}}")], ""),
        ("timeseries", "Expert slots used per tier", "short",
         [("sum by (tier) (betelgeuse_expert_slots{state=\"used\"})", "{{tier}} used"),
          ("sum by (tier) (betelgeuse_expert_slots)", "{{tier}} total")], ""),
        ("timeseries", "Host-slot churn", "short",
         [(rate("betelgeuse_expert_loads_total", by="reason"), "loads {{reason}}"),
          (rate("betelgeuse_expert_evictions_total"), "evictions")], ""),
    ]),
    ("Disk and PCIe", [
        ("timeseries", "Disk read bytes/s", "Bps",
         [(rate("betelgeuse_disk_read_bytes_total", by="reason"), "{{reason}}")], "Reads by the store (O_DIRECT)."),
        ("timeseries", "Disk wait share of busy time", "percentunit",
         [(f"{rate('betelgeuse_disk_wait_seconds_total', by='phase')} / "
           f"{rate('betelgeuse_engine_busy_seconds_total', by='phase')}", "{{phase}}")],
         "Time compute stalled on disk-resident experts."),
        ("timeseries", "Disk read latency", "s",
         [(quantile(q, "betelgeuse_disk_read_duration_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.99)], ""),
        ("timeseries", "Host to device bytes/s", "Bps",
         [(rate("betelgeuse_host_to_device_bytes_total"), "h2d"),
          (f"{rate('betelgeuse_host_to_device_bytes_total')} / {rate('betelgeuse_host_to_device_seconds_total')}",
           "effective bandwidth")], ""),
        ("stat", "O_DIRECT reads", "short", [("min(betelgeuse_disk_direct_io)", "direct")],
         "1 = page cache bypassed; 0 = buffered fallback (tmpfs, overlay)."),
    ]),
    ("Memory", [
        ("timeseries", "cgroup memory against the limit", "bytes",
         [("betelgeuse_cgroup_memory_bytes{kind=\"current\"}", "{{job}}"),
          ("sum(betelgeuse_cgroup_memory_bytes{kind=\"current\"})", "both"),
          ("max(betelgeuse_cgroup_memory_bytes{kind=\"max\"})", "memory.max")], ""),
        ("timeseries", "VRAM in use", "bytes",
         [("sum by (pool) (betelgeuse_vram_used_bytes)", "{{pool}}"),
          ("max(betelgeuse_vram_budget_bytes)", "budget")], ""),
        ("timeseries", "Resident memory per process", "bytes",
         [("process_resident_memory_bytes{job=~\"betelgeuse-.*\"}", "{{job}} RSS"),
          ("max(betelgeuse_arena_bytes)", "host-slot arena")], ""),
    ]),
    ("Requests", [
        ("timeseries", "Request rate by status code", "reqps",
         [(rate("betelgeuse_requests_total", by="code"), "{{code}}")], ""),
        ("timeseries", "Error ratio", "percentunit",
         [(f"{rate('betelgeuse_requests_total', sel=FAILED)} / {rate('betelgeuse_requests_total')}",
           "errors")], "Failed RPCs (not OK, not cancelled by the client) over all RPCs."),
        ("timeseries", "Running and waiting", "short",
         [("sum(betelgeuse_requests_running)", "running"), ("sum(betelgeuse_requests_waiting)", "waiting")], ""),
        ("timeseries", "Finished generations by reason", "short",
         [(rate("betelgeuse_requests_finished_total", by="finish_reason"), "{{finish_reason}}")], ""),
        ("stat", "Ready", "short", [("min by (job) (betelgeuse_ready)", "{{job}}")], "1 = serving."),
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
                                 "query": "prometheus", "current": {}, "hide": 0}]},
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
