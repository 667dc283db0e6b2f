"""Benchmark results on disk: bench.json (everything), bench.md (the reference report's table and the
rest), bench.png (achieved vs bound per pass; per-layer time split of the first cold and warm passes).

matplotlib draws the PNG where it is installed; otherwise a plain bar chart is rasterized with numpy
and written with zlib, so a machine without matplotlib still gets a well-formed picture.
"""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np

from services.bench.disk_idle import idle_label

GB = 1e9
MiB = 1 << 20


def machine_info() -> dict:
    import torch
    info = {"kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "cpu": "", "ram_bytes": 0, "gpu": None}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        with open("/proc/meminfo") as f:
            info["ram_bytes"] = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        info["gpu"] = out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _pct(x):
    return _f(None if x is None else 100 * x, "{:.2f}%")


# the approximate routing modes, as the report names them (betelgeuse/routing_approx.py; report.py stays torch-free)
APPROX_NOTE = {"resident": "`resident` = rank 0 exact, ranks >= 1 among resident experts",
               "pool": "`pool` = every rank among resident experts (the reference report's routing)"}


def case_label(case: dict) -> str:
    """A case's name; an approximate routing mode's case carries its divergence from exact beside it."""
    mode = case.get("routing_mode", "exact")
    if mode == "exact":
        return case["name"]
    d = case.get("divergence") or {}
    div = (f"top-1 {d['top1']:.1%}, KL {d['kl']:.4f} nats/token" if "top1" in d
           else f"divergence not measured: {d.get('skipped', 'case incomplete')}")
    return f"{case['name']} (APPROXIMATE {mode}; vs exact: {div})"


def achieved_label(b: dict) -> str:
    """The achieved fraction of a bound, or "bound wrong" where the pass beat it (ceilings.BOUND_WRONG)."""
    if b.get("bound_wrong"):
        return f"**bound wrong** (pass beat it: {b['achieved']:.2f})"
    return _pct(b.get("achieved"))


def _guess_mb(d: dict) -> str:
    """Decode's reads ahead for guessed experts (worker/guess.py): 'MB (wasted MB)', the store's own count where the
    record has it (bytes read ahead that landed, and of them those no load took: a dropped guess was never read)."""
    if d.get("store_readahead_bytes") is not None:
        got = d["store_readahead_bytes"]
        return f"{got / 1e6:,.1f} ({(got - d['store_readahead_used_bytes']) / 1e6:,.1f})"
    g = d.get("guess")
    if not g:
        return "–"
    return f"{g['guess_bytes'] / 1e6:,.1f} ({g['guess_wasted_bytes'] / 1e6:,.1f})"


def _guess_rate(d: dict) -> str:
    """Decode's guess hit rate on disk experts, and where it copied host-tier experts ahead (prefetch_host) theirs,
    and where it read the hash-routed layers' experts at the step's start (prefetch_hash) those: 'hit rate; host:
    used / copied ahead (rate); hash ahead: started of asked (MB, used)'."""
    g, out = d.get("guess") or {}, _pct(d.get("guess_hit_rate"))
    if g.get("host_guessed"):
        out += f"; host: {g['host_guess_hits']:,} / {g['host_guessed']:,} ({_pct(d.get('host_guess_hit_rate'))})"
    if g.get("hash_ahead"):     # the hash-routed layers' reads at the step's start (MoEStep.hash_ahead)
        out += (f"; hash ahead: {g['hash_ahead_started']:,} started of {g['hash_ahead']:,} "
                f"({g['hash_ahead_bytes'] / 1e6:,.1f} MB, used {g['hash_ahead_hits']:,})")
    return out


def _host_split(d: dict) -> str:
    """A decode record's host time by part, per expert application (µs), its store wait per token (ms) and its store
    messages per token by kind: three table cells ("–" for a record from before the split)."""
    if "store_s" not in d:
        return "– | – | –"
    n = max(1, d["tokens"])
    parts = " / ".join(_f(d.get(k), "{:.1f}") for k in ("store_us_per_application", "moe_host_us_per_application",
                                                          "other_host_us_per_application"))
    if d.get("group_graphs"):       # engine.group_graphs: how the eager groups ran (worker/group_graphs.py)
        g = d["group_graphs"]
        parts += f" (group graphs: {g['replays']:,} replays, {g['captures']:,} captures, {g['launches']:,} launches)"
    if d.get("disk_flushes"):       # engine.disk_flush_early: a group more each (worker/moe_step.py _disk_groups)
        parts += f" (early disk flushes: {d['disk_flushes'] / n:.2f} / token)"
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in d.get("store_messages_per_token", {}).items()) or "none"
    return f"{parts} | {d['store_wait_s'] / n * 1e3:,.1f} | {kinds}"


def triton_compiles(rec: dict | None, first: list | None = None) -> str:
    """A timed region's Triton compiles (kernels/triton_launch.compiles_since): "count (seconds s): kernel n, ..."
    (first: per token counts, the first token's added; the variants with local bytes per thread, the worst named),
    "n/a (why)" where they were not counted, "–" for a record from before they were."""
    if not rec:
        return "–"
    if rec.get("count") is None:
        return f"n/a ({rec.get('na', '?')})"
    txt = f"{rec['count']} ({rec['seconds']:.2f} s)"
    if first:
        txt += f", first token {first[0] if first[0] is not None else '–'}"
    names = sorted((rec.get("names") or {}).items(), key=lambda kv: -kv[1])
    txt += (": " + ", ".join(f"`{n}` {c}" for n, c in names[:6]) if names else "")
    if rec.get("spilling"):   # local bytes per thread: the driver's local-memory reservation (triton_launch)
        lmem = f", ~{rec['lmem_mib']:,.0f} MiB of local memory reserved" if rec.get("lmem_mib") else ""
        txt += f"; SPILLING ({len(rec['spilling'])}, max {rec['max_local']} B/thread{lmem}): `{rec['spilling'][0]}`"
    return txt


def attach_vram(warmed: dict | None) -> str:
    """What attach's steps put on the GPU (worker/attach_steps.py; a runner's `warmed`): "step +device/+torch MiB
    (outside torch +x)" per step that moved, a failed warm-up as "step FAILED (error)", "warm-ups off" where they
    were; "–" without figures (the CPU, a record from before them)."""
    w = warmed or {}
    parts = ["warm-ups off"] if w.get("warm_up") == "off" else []
    for step, v in (w.get("vram") or {}).items():
        dev, tor = v.get("device_mib", 0), v.get("torch_reserved_mib", 0)
        if step != "session" and abs(dev) < 0.5 and abs(tor) < 0.5 and "torch_peak_mib" not in v:
            continue                                # nothing moved: left out (the row stays short)
        txt = f"{step} {dev:+,.0f}/{tor:+,.0f}"
        if abs(dev - tor) >= 0.5 and step != "session":
            txt += f" (outside torch {dev - tor:+,.0f})"
        if "torch_peak_mib" in v:
            txt += f" (torch peak {v['torch_peak_mib']:,.0f})"
        parts.append(txt)
    key = {"warm_routes": "routes", "warm_kernels": "kernels", "warm_decode": "decode"}
    for step, k in key.items():
        failed = w[k].get("failed") if isinstance(w.get(k), dict) else None
        if failed:
            parts.append(f"{step} FAILED ({failed})")
    if w.get("vram"):
        last = list(w["vram"].values())[-1]
        parts.append(f"device used after {last['used_mib']:,.0f}")
    if w.get("vram_fit"):
        parts.append(f"budget check: {vram_fit_text(w['vram_fit'])}")
    return "; ".join(parts) if parts else "–"


def vram_fit_text(f: dict) -> str:
    """A VRAM check's numbers (worker/vram_fit.py VramFit.record: the runner's warmed["vram_fit"], a plan's vram_trim)
    in MiB: "outside torch 1,364 (plan allowed 1,024), projected 12,490 of 12,288"."""
    if "projected" not in f:
        return "no figures"
    m = lambda k: f"{f[k] / MiB:,.0f}"          # noqa: E731
    return (f"outside torch {m('non_torch')} (plan allowed {m('allowance')}), projected {m('projected')} of "
            f"{m('budget')}")


def _passes(r: dict):
    for case in r.get("cases", []):
        for p in case.get("passes", []):
            yield case, p


def markdown(r: dict) -> str:
    m, mem, vram, ceil = r.get("machine", {}), r.get("memory", {}), r.get("vram", {}), r.get("ceilings", {})
    L = [f"# Betelgeuse benchmark: {r.get('run', '')}", "",
         f"Command: `{r.get('command', '')}`", "",
         f"Machine: GPU {m.get('gpu') or 'none'}; CPU {m.get('cpu', '')} x{m.get('cpus', '')}; "
         f"RAM {m.get('ram_bytes', 0) / 2**30:.0f} GiB; kernel {m.get('kernel', '')}; torch {m.get('torch', '')}; "
         f"device `{r.get('device', '')}`", ""]
    if r.get("status") != "complete":
        L += [f"**Partial results** (status: {r.get('status')}).", ""]
    o = r.get("options", {})
    approx = [m for m in o.get("routings") or (o.get("routing", "exact"),) if m != "exact"]
    if approx:
        L += [f"**Routing {', '.join(o.get('routings') or (o['routing'],))}: {'; '.join(APPROX_NOTE[m] for m in approx)}. "
              "APPROXIMATE modes' outputs differ from the model's: every figure of theirs is printed beside its "
              "divergence from exact routing on the case's prompt (top-1 agreement, mean KL per token; "
              "betelgeuse/routing_approx.py).**", ""]
    if o.get("vram_backing") is False:
        L += ["Slots: VRAM experts keep no host copy (`--no-vram-backing`): VRAM slots add resident capacity.", ""]
    if o.get("routing_trace"):
        L += [f"**Routing REPLAYED from `{o['routing_trace']}`: every pass's experts come from the trace, not the "
              "router, so the outputs are meaningless; caching, disk and copies are measured on the trace's routing. "
              "Decode runs without CUDA graphs (the replay hook runs at every layer).**", ""]
    L += ["## Prefill (the reference table: pass 4a cold, 4b warm)", "",
          "| Case | Router | Slots/layer (VRAM+host) | Pass | Schedule | Tokens | PP tok/s | Disk read share | "
          "Disk wait ms | H2D GB | TTFT s | Bound s (limiter) | Achieved |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, p in _passes(r):
        plan = case.get("plan", {})
        b = p.get("bound", {})
        trim = plan.get("vram_trim")
        slots = (f"{plan.get('n_vram', '?')}+{plan.get('n_host', '?')} ({case['slots_requested']}"
                 + (f"; VRAM TRIMMED at attach {trim['slots_before']} -> {trim['slots_after']}: {vram_fit_text(trim)}"
                    if trim else "") + ")")
        label = p["label"] + ("" if p.get("complete", True) else " (partial)")
        router = case.get("router", case.get("router_skew"))
        L.append(f"| {case_label(case)} | {router} | {slots} | {label} | {p['schedule']} | "
                 f"{p['n_tokens']}/{p.get('prompt_tokens', p['n_tokens'])} | {p['tok_per_s']:.2f} | "
                 f"{_pct(p.get('disk_share'))} | {_f(p.get('disk_wait_ms'), '{:,.0f}')} | "
                 f"{_f(None if 'h2d_bytes' not in p else p['h2d_bytes'] / GB)} | {_f(p.get('ttft_s'), '{:.3f}')} | "
                 f"{_f(b.get('bound_s'), '{:.3f}')} ({b.get('limiter', '–')}) | {achieved_label(b)} |")
    L += routing_section(r)
    L += ["", "## Host cost per pass", "",
          "Host time = wall minus the time the host was blocked (routing syncs, disk waits, copy waits, the end "
          "sync), so it is the time spent issuing work; per expert application = host time / applications. "
          "Launches per layer and GPU busy (union of kernel time / wall) come from one extra profiled pass of the "
          "same kind (torch.profiler), not the timed one.", "",
          "| Case | Pass | Applications | Host ms | Host µs / application | Store calls | Launches / layer | "
          "GPU busy | Triton compiles (s) |",
          "|---|---|---|---|---|---|---|---|---|"]
    for case, p in _passes(r):
        if "host_s" not in p:
            continue
        prof = case.get("profile", {}).get(p["label"], {})
        L.append(f"| {case_label(case)} | {p['label']} | {p['loads']} | {p['host_s'] * 1e3:,.1f} | "
                 f"{_f(p.get('host_us_per_application'), '{:.1f}')} | {p.get('store_calls', '–')} | "
                 f"{_f(prof.get('launches_per_layer'), '{:.1f}')} | {_pct(prof.get('gpu_busy'))} | "
                 f"{triton_compiles(p.get('triton_compiles'))} |")
    L += ["", "## Decode", "",
          "| Case | Tokens | TG tok/s mean | TG tok/s peak | Disk read share | Disk wait ms | Bound tok/s (limiter) | "
          "Achieved | Disk busy | Host µs / application | Store calls / token | Launches / layer | Guess hit rate | "
          "Read ahead MB (wasted) | Host µs / app.: store messages / expert step / rest | Store wait ms / token | "
          "Store messages / token by kind | First token host ms | Triton compiles in the timed tokens (s) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in r.get("cases", []):
        d = case.get("decode")
        if d:
            b = d.get("bound", {})
            prof = case.get("profile", {}).get("decode", {})
            bt = d["tokens"] / b["bound_s"] if b.get("bound_s") else None
            L.append(f"| {case_label(case)} | {d['tokens']}/{d['requested']} | {d['tg_mean']:.2f} | {d['tg_peak']:.2f} | "
                     f"{_pct(d['disk_share'])} | {d['disk_wait_ms']:,.0f} | {_f(bt)} ({b.get('limiter', '–')}) | "
                     f"{achieved_label(b)} | {_pct(d.get('disk_busy_fraction'))}{idle_label(d)} | "
                     f"{_f(d.get('host_us_per_application'), '{:.1f}')} | "
                     f"{_f(d.get('store_calls_per_token'), '{:.2f}')} | {_f(prof.get('launches_per_layer'), '{:.1f}')} | "
                     f"{_guess_rate(d)} | {_guess_mb(d)} | {_host_split(d)} | "
                     f"{_f(d['token_host_s'][0] * 1e3 if d.get('token_host_s') else None, '{:,.1f}')} | "
                     f"{triton_compiles(d.get('triton_compiles'), d.get('token_triton_compiles'))} |")
    eng = [(case, p) for case, p in _passes(r) if p.get("engram")]
    eng += [(case, dict(case["decode"], label="decode")) for case in r.get("cases", [])
            if (case.get("decode") or {}).get("engram")]
    if eng:
        L += ["", "## Engram rows (deepseek41: read by the store from the tables on disk)", "",
              "| Case | Pass | Rows / token | Disk bytes / token | Rows from disk / cache | Store requests | "
              "Engram wait ms | Wait share of the pass | Feed share of the pass |", "|---|---|---|---|---|---|---|---|---|"]
        for case, p in eng:
            e = p["engram"]
            L.append(f"| {case['name']} | {p['label']} | {e['rows_per_token']:.1f} | {e['disk_bytes_per_token']:,.0f} | "
                     f"{e['disk_rows']} / {e['cache_rows']} | {e['requests']} | {e['wait_ms']:,.1f} | "
                     f"{_pct(e.get('wait_share'))} | {_pct(e.get('feed_share'))} |")
    attach = [c for c in r.get("cases", []) if "attach_s" in c]
    if attach:
        L += ["", "## Attach (issue 21: the compile warm-ups and what each attach step put on the GPU)", "",
              "| Case | Attach s | Triton compiles at attach (s) | VRAM by step, MiB device-wide / torch reserved |",
              "|---|---|---|---|"]
        for case in attach:
            L.append(f"| {case_label(case)} | {case['attach_s']:.2f} | "
                     f"{triton_compiles(case.get('attach_triton_compiles'))} | "
                     f"{attach_vram(case.get('kernel_warmup'))} |")
    L += ["", "## Warm layer-major vs standard (same prompt, same warm state)", ""]
    for case in r.get("cases", []):
        ps = {p["label"]: p for p in case.get("passes", [])}
        if "warm" in ps and "std" in ps and ps["std"]["tok_per_s"] > 0:
            L.append(f"- {case['name']}: {ps['warm']['tok_per_s']:.2f} / {ps['std']['tok_per_s']:.2f} tok/s = "
                     f"**{ps['warm']['tok_per_s'] / ps['std']['tok_per_s']:.1f}x**")
    L += ["", "## Budgets", "",
          f"- Peak VRAM: {_f(None if vram.get('peak_bytes') is None else vram['peak_bytes'] / MiB, '{:,.0f}')} MiB "
          f"(device-wide, above the {vram.get('baseline_bytes', 0) / MiB:,.0f} MiB in use before start; torch max reserved "
          f"{_f(None if vram.get('torch_max_reserved') is None else vram['torch_max_reserved'] / MiB, '{:,.0f}')} MiB) "
          f"under a budget of {vram.get('budget', 0) / 2**30:.0f} GiB",
          f"- Peak cgroup memory: {_f(None if not mem.get('peak') else mem['peak'] / 2**30, '{:.2f}')} GiB of limit "
          f"{_f(None if not mem.get('limit') else mem['limit'] / 2**30, '{:.2f}')} GiB "
          f"({mem.get('cgroup') or 'no cgroup: ' + str(mem.get('reason'))}); OOM kills: {mem.get('oom_kills', '–')}; "
          f"swap limit {mem.get('swap_limit', '–')}, swap peak {mem.get('swap_peak', '–')}",
          "", "## Ceilings (measured in this run)", "",
          "- Disk (O_DIRECT, store reader settings): " + ", ".join(
              f"{s.get('pattern', 'random')} {s['bps'] / GB:.2f} GB/s ({s['mode']}, t={s['at_s']:.0f}s)"
              for s in ceil.get("disk", []))
          + "; sampled before and after every case in both ways the store's loads read (random: batches of random "
            "experts, each waited for; layer: whole layers' experts in file order, the queue kept full): a pass's "
            "disk bound uses the fastest of those four samples (max(random, layer) on each side) and the rate of "
            "its own reads (bytes x reader threads / their time in preadv); a pass that still beats its bound by "
            "more than 2% is printed as **bound wrong**, not as a fraction",
          f"- Host->device: {ceil.get('h2d_bps', 0) / GB:.2f} GB/s "
          f"({'pinned arena' if ceil.get('h2d_pinned') else 'memcpy / pageable'})",
          "- Expert compute (the engine's kernels, one launch group of a bank of experts; per expert application): "
          + ", ".join(f"{k} rows {v * 1e6:.1f} µs ({ceil.get('hbm_bps', {}).get(k, 0) / GB:.0f} GB/s of expert bytes)"
                      for k, v in ceil.get("mm_s", {}).items())]
    L += [f"  - {t} ({v['layers']} layers, {v['backend']}): "
          + ", ".join(f"{k} rows {x / GB:.0f} GB/s" for k, x in v["hbm_bps"].items())
          for t, v in ceil.get("by_type", {}).items()] + [""]
    skipped = r.get("skipped", []) + [dict(s, case=c["name"]) for c in r.get("cases", []) for s in c.get("skipped", [])]
    if skipped:
        L += ["## Skipped", ""] + [f"- {s.get('case')} {s.get('pass', '')}: {s['reason']}" for s in skipped] + [""]
    if r.get("errors"):
        L += ["## Errors", ""] + [f"- {e}" for e in r["errors"]] + [""]
    return "\n".join(L)


def routing_section(r: dict) -> list[str]:
    """The routing each case's passes saw (harness._routing), beside the calibration target."""
    rows, target = [], None
    for case in r.get("cases", []):
        rt = case.get("routing") or {}
        target = target or (rt.get("router", {}).get("target") and rt["router"])
        for part in ("prompt", "decode", "prompt_routed_layers", "decode_routed_layers"):
            st = rt.get(part)
            if not st:
                continue
            n = rt["prompt_tokens"] if part.startswith("prompt") else rt["decode_tokens"]
            what = part.replace("_routed_layers", " (router layers only)")
            rw = st.get("rank_weight") or [None]
            rows.append(f"| {case['name']} | {case.get('router')} | {what} | {n} | {_pct(st['repeat_next'])} | "
                        f"{_pct(st['within_8'])} | {_f(st['reuse_median'], '{:.0f}', 'inf')} | "
                        f"{_pct(st['lru_hit_40'])} | {_pct(st['top_share_25'])} | {_f(rw[0], '{:.3f}')} |")
    if not rows:
        return []
    L = ["", "## Routing (what the expert cache saw)", "",
         "The experts the passes chose, recorded by one more untimed prefill of the prompt and the decoded tokens "
         "(a token's experts depend only on the tokens before it); statistics from betelgeuse/routing_stats.py. "
         "Published Qwen3-30B-A3B decode: 45% repeat at the next token, 80% within 8, median reuse distance 2, LRU "
         "at 40% residency 90-95% (docs/benchmarks/routing-locality.md). Random prompts have no repeated tokens; "
         "greedy decode of a random model may loop, which repeats routing.", "",
         "| Case | Router | Tokens | n | Repeat at next | Within 8 | Reuse median | LRU hit at 40% | Top-25% share | "
         "Rank-0 weight |", "|---|---|---|---|---|---|---|---|---|---|"] + rows
    if target:
        t = target["target_stats"]
        rw = t.get("rank_weight") or [None]
        L.append(f"| target | {target['target']} | decode | 512 | {_pct(t.get('repeat_next'))} | "
                 f"{_pct(t.get('within_8'))} | {_f(t.get('reuse_median'), '{:.0f}')} | {_pct(t.get('lru_hit_40'))} | "
                 f"{_pct(t.get('top_share_25'))} | {_f(rw[0], '{:.3f}')} |")
    return L


# ---- PNG ---------------------------------------------------------------------------------------------
def _layer_split(p: dict) -> np.ndarray:
    """[n_layer, 5] seconds: dense/attention, disk wait, copy, compute, other host time."""
    rows = []
    for ls in p.get("layers", []):
        wall = ls["attn_s"] + ls["moe_s"]
        known = ls["attn_s"] + ls["disk_wait_s"] + ls["copy_s"] + ls["compute_s"]
        rows.append([ls["attn_s"], ls["disk_wait_s"], ls["copy_s"], ls["compute_s"], max(0.0, wall - known)])
    return np.array(rows).reshape(-1, 5)


def _chart_data(r: dict):
    bars = [(f"{c['name']}:{p['label']}", p["seconds"], p["bound"]["bound_s"]) for c, p in _passes(r) if "bound" in p]
    picks = []
    for case, p in _passes(r):
        if p["label"] in ("cold", "warm") and p.get("layers") and all(q[0] != p["label"] for q in picks):
            picks.append((p["label"], case["name"], _layer_split(p)))
    return bars, picks


SPLIT = ("attention+routing", "disk wait", "copy", "expert compute", "other host")


def write_png(r: dict, path: Path) -> str:
    bars, picks = _chart_data(r)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_png(bars, picks, path)
        return "numpy"
    fig, axes = plt.subplots(1 + len(picks), 1, figsize=(12, 4 + 3.5 * len(picks)))
    axes = np.atleast_1d(axes)
    ax = axes[0]
    x = np.arange(len(bars))
    ax.bar(x - 0.2, [b[1] for b in bars], 0.4, label="actual s")
    ax.bar(x + 0.2, [b[2] for b in bars], 0.4, label="bound s")
    for i, b in enumerate(bars):
        ax.text(i, max(b[1], b[2]), f"{100 * b[2] / b[1]:.0f}%" if b[1] else "", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [b[0] for b in bars], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("Per pass: actual vs physical bound (label: achieved = bound / actual)")
    ax.legend()
    for ax, (label, name, split) in zip(axes[1:], picks):
        bottom = np.zeros(len(split))
        for j, part in enumerate(SPLIT):
            ax.bar(np.arange(len(split)), split[:, j], bottom=bottom, label=part)
            bottom += split[:, j]
        ax.set_title(f"Per-layer time split: {name}, {label} pass (copy: measured or bytes / measured bandwidth)")
        ax.set_xlabel("layer")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return "matplotlib"


def _raster_png(bars, picks, path: Path, w: int = 800, h_panel: int = 200) -> None:
    """No matplotlib: grouped bars (actual grey, bound blue) and stacked per-layer splits, no text."""
    colors = np.array([[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189]], np.uint8)
    panels = [np.full((h_panel, w, 3), 255, np.uint8) for _ in range(1 + len(picks))]
    top = max([max(b[1], b[2]) for b in bars] + [1e-9])
    n = max(len(bars), 1)
    for i, (_, actual, bound) in enumerate(bars):
        x0 = int(i * w / n)
        bw = max(1, int(w / n / 2) - 1)
        for k, (v, col) in enumerate(((actual, (128, 128, 128)), (bound, tuple(colors[0])))):
            hgt = int((h_panel - 10) * v / top)
            panels[0][h_panel - hgt:, x0 + k * bw: x0 + (k + 1) * bw] = col
    for img, (_, _, split) in zip(panels[1:], picks):
        tot = max(split.sum(1).max() if len(split) else 0, 1e-9)
        n = max(len(split), 1)
        for i, row in enumerate(split):
            x0, x1, y = int(i * w / n), max(int((i + 1) * w / n) - 1, int(i * w / n) + 1), h_panel
            for j, v in enumerate(row):
                hgt = int((h_panel - 10) * v / tot)
                img[max(y - hgt, 0):y, x0:x1] = colors[j]
                y -= hgt
    _write_png(np.concatenate(panels, 0), path)


def _write_png(rgb: np.ndarray, path: Path) -> None:
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
    path.write_bytes(png)


def write_results(r: dict, out_dir: str | Path, png: bool, render=None) -> dict:
    """Write bench.json and bench.md (and bench.png when `png`); atomically, so a kill mid-write
    leaves the previous version. `render(r) -> str` makes the markdown (default: this suite's). Returns {kind: path}."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / "bench.json", "md": d / "bench.md"}
    for kind, text in (("json", json.dumps(r, indent=1, default=str)), ("md", (render or markdown)(r))):
        tmp = paths[kind].with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, paths[kind])
    if png:
        paths["png"] = d / "bench.png"
        r["png_renderer"] = write_png(r, paths["png"])
    return {k: str(v) for k, v in paths.items()}


def run_recorded(results: dict, save, run, log) -> int:
    """Run a suite (run()) with its results saved whatever happens: status complete / complete with errors /
    interrupted / failed, the files written in the end, every recorded error logged. Returns the exit status."""
    from betelgeuse.errors import BetelgeuseError
    try:
        run()
        results["status"] = "complete" if not results["errors"] else "complete with errors"
    except KeyboardInterrupt:
        results["status"] = "interrupted"
        raise
    except BetelgeuseError as e:
        results["status"] = "failed"
        results["errors"].append(str(e))
        raise
    finally:
        if results["status"] == "running":
            results["status"] = "failed"
        paths = save(True)
        log(f"wrote {', '.join(paths.values())}")
    for e in results["errors"]:
        log(f"error: {e}")
    return 0 if not results["errors"] else 1
