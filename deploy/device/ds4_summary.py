#!/usr/bin/env python3
"""The issue-21 figures of a deepseek4 bench run, from its bench.json (step 5 of bench_ds4.sh).

    python3 deploy/device/ds4_summary.py OUT/RUN/bench.json [--out OUT/RUN/ds4_summary.md]

First issue 21's target table, PASS/MISS per row, from the exact and the pool cases of the 64-token prompt (bench
--routing exact,pool): decode host µs per expert application and launches per layer (exact), every pass's and decode
run's achieved fraction of its bound (0.8-1.0, none "bound wrong"), the peak VRAM against 12,288 MiB, and for pool
routing the warm repeated prompt's disk share, decode TG, warm PP and the divergence from exact routing. Then per
case: decode TG (mean / peak) and its disk share, host µs per expert application, kernel launches per layer (the
bench's profiled decode step and warm pass), the decode run's bound and the achieved fraction of it ("bound wrong"
where the run beat it); then every pass's and decode run's disk achieved split into factors (disk_split_table), the
peak VRAM against the budget, the disk rates sampled in the run and the disk's depth curve (bench --disk-depths).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# the idle gaps by what ended them, their chain and its gpu part's split
from services.bench.disk_idle import CHAIN, GPU, chain_label, ended_label, gpu_label
from services.bench.report import attach_vram                      # attach's steps' VRAM, as bench.md
from services.bench.report import triton_compiles as _compiles   # a region's Triton compiles, as bench.md

MiB, GB = 1 << 20, 1e9


def _f(v, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


VRAM_TARGET_MIB = 12288


def _case(r: dict, mode: str) -> dict:
    """The first main-model layer-major case of this routing mode, of the 64-token prompt where one ran ({} if
    none ran)."""
    cs = [c for c in r.get("cases", []) if c.get("routing_mode", "exact") == mode
          and not c["name"].startswith("variant") and any(p.get("label") == "warm" for p in c.get("passes", []))]
    return next((c for c in cs if c.get("prompt_tokens") == 64), cs[0] if cs else {})


def _pass(c: dict, label: str) -> dict:
    return next((p for p in c.get("passes", []) if p.get("label") == label and p.get("complete", True)), {})


def _row(figure: str, target: str, value, ok) -> str:
    verdict = "–" if ok is None else ("PASS" if ok else "MISS")
    return f"| {figure} | {target} | {value} | {verdict} |"


def host_wait_fit(token_s: list[float], token_host_s: list[float], skip: int = 2) -> tuple[float, float] | None:
    """A decode run's tokens' host time against their wall (both s, one a token; the first `skip` tokens left out: a
    first token's own host) -> (correlation, slope: host s per s of wall), or None with under 3 tokens or no spread.
    gpu-run68: at the same work a token's host grew ~49 µs per ms of its wait for the disk (host_vs_wait.py there),
    so a change that keeps the waiting core hot (store.session_reader spin) should flatten this slope."""
    w, h = token_s[skip:], token_host_s[skip:]
    if len(w) < 3 or len(w) != len(h):
        return None
    mw, mh = sum(w) / len(w), sum(h) / len(h)
    vw = sum((x - mw) ** 2 for x in w) / len(w)
    vh = sum((y - mh) ** 2 for y in h) / len(h)
    if vw <= 0 or vh <= 0:
        return None
    cov = sum((x - mw) * (y - mh) for x, y in zip(w, h)) / len(w)
    return cov / (vw * vh) ** 0.5, cov / vw


def host_work_fit(token_host_s: list[float], disk_reads: list[int], sleeps: list[int],
                  skip: int = 2) -> dict | None:
    """A decode run's tokens' host time (s) fitted by least squares to their disk reads and their sleeps in waits for
    the store (one each a token; the first `skip` left out) -> {"per_read_us", "per_sleep_us", "r2"}, a count without
    spread dropped from the fit (its figure None), or None with under 4 tokens or neither spread. A disk read is work
    (its copy, its group); a sleep is a wake after it: if the host's growth with the wait (gpu-run68) is a cold wake's,
    the host rises with the sleeps at the same reads, and keeping the core hot (hold_latency.py, the spin reader)
    lowers per_sleep_us or the sleeps themselves."""
    h, cols = token_host_s[skip:], {"per_read_us": disk_reads[skip:], "per_sleep_us": sleeps[skip:]}
    if len(h) < 4 or any(len(v) != len(h) for v in cols.values()):
        return None
    used = [k for k, v in cols.items() if max(v) > min(v)]
    if not used:
        return None
    x = np.column_stack([np.ones(len(h))] + [np.asarray(cols[k], float) for k in used])
    y = np.asarray(h, float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    res = y - x @ coef
    ss = float(((y - y.mean()) ** 2).sum())
    out = dict.fromkeys(cols)
    out.update({k: float(c) * 1e6 for k, c in zip(used, coef[1:])})
    out["r2"] = 1 - float((res ** 2).sum()) / ss if ss > 0 else None
    return out


def targets(r: dict) -> list[str]:
    """Issue 21's target table from the exact and pool cases of the 64-token prompt."""
    ex, pool = _case(r, "exact"), _case(r, "pool")
    exd, pd, pw = ex.get("decode") or {}, pool.get("decode") or {}, _pass(pool, "warm")
    n = pool.get("prompt_tokens") or ex.get("prompt_tokens")
    L = [f"## Issue 21 targets (ds4-flash, {n}-token prompt; exact case "
         f"`{ex.get('name', 'not run')}`, pool case `{pool.get('name', 'not run')}`)", "",
         "| figure | target | measured | verdict |", "|---|---|---|---|"]
    L.append(_row("decode TG, exact (tok/s)", "– (context)", _f(exd.get("tg_mean"), "{:.2f}"), None))
    hu = exd.get("host_us_per_application")
    # --gpu-marks turns the decode's fold off and cuts its solo graph at each attention (worker/moe_step.py
    # hand_fold, cpu-host65): the host it times is not the shipped decode's, so no verdict from such a run
    marked = bool((r.get("options") or {}).get("gpu_marks"))
    L.append(_row("decode host µs / expert application, exact", "≤ 100",
                  _f(hu) + (" (--gpu-marks on: the fold off, not the shipped decode's host)" if marked else ""),
                  None if hu is None or marked else hu <= 100))
    if "store_s" in exd:      # the host time's parts (worker/stats.py) and the store wait, beside the target
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in exd.get("store_messages_per_token", {}).items()) or "none"
        L.append(_row("  of it: store messages / expert step / rest (µs per application)", "–",
                      " / ".join(_f(exd.get(k)) for k in ("store_us_per_application", "moe_host_us_per_application",
                                                          "other_host_us_per_application"))
                      + f"; median token {_f(exd.get('host_us_per_application_median'))} µs"
                      # tokens 3 on (services/bench/harness.py HostSplit.steady; absent from earlier records)
                      + ("; steady tokens " + " / ".join(_f(exd["steady_split_us_per_application"][k]) for k in
                                                           ("store", "moe", "other"))
                         if exd.get("steady_split_us_per_application") else "")
                      + f"; store wait {exd['store_wait_s'] / max(1, exd['tokens']) * 1e3:.1f} ms/token (blocked); "
                      # BeginPass / EndPass replies (blocked since cpu-spike56; absent from earlier records)
                      + (f"pass-boundary reply wait {exd['store_reply_wait_s'] / max(1, exd['tokens']) * 1e3:.2f} "
                         "ms/token (blocked); " if "store_reply_wait_s" in exd else "")
                      + f"messages/token: {kinds}", None))
    if "disk_flushes" in exd:  # engine.disk_flush_early (worker/moe_step.py _disk_groups): a group more each
        L.append(_row("  decode, exact: early disk flushes / token (engine.disk_flush_early; 0: off or none late)",
                      "–", f"{exd['disk_flushes'] / max(1, exd['tokens']):.2f}", None))
    fit = host_wait_fit(exd.get("token_s") or [], exd.get("token_host_s") or [])
    if fit is not None:      # does the host grow with the wait (gpu-run68)? tokens against tokens, within this run
        L.append(_row("  decode, exact: a token's host against its wall, within the run (r; µs of host per ms of wall; "
                      "docs/benchmarks/gpu-run68)", "–", f"r {fit[0]:+.2f}; {fit[1] * 1e3:.1f}", None))
    if exd.get("token_store_sleeps"):   # the waits a token and the sleeps in them (worker/stats.py store_sleeps)
        n_ = max(1, len(exd["token_store_sleeps"]))
        wf = host_work_fit(exd.get("token_host_s") or [], exd.get("token_disk_reads") or [],
                           exd["token_store_sleeps"])
        L.append(_row("  decode, exact: waits for the store / of them slept in / disk reads, a token; host fitted to "
                      "reads and sleeps (µs each; r²)", "–",
                      f"{sum(exd['token_store_waits']) / n_:.1f} / {sum(exd['token_store_sleeps']) / n_:.1f} / "
                      f"{sum(exd['token_disk_reads']) / n_:.1f}; "
                      + ("no fit" if wf is None else
                         f"{_f(wf['per_read_us'])} a read, {_f(wf['per_sleep_us'])} a sleep; r² {_f(wf['r2'], '{:.2f}')}"),
                      None))
    wt = ((exd.get("threads") or {}).get("worker") or {}).get("threads")
    if wt is not None:       # the bench process's threads over the timed tokens (services/bench/threads.py): every
        others = {k: v for k, v in wt.items() if v.get("python") and k != "MainThread"}   # other Python thread's
        L.append(_row("  decode, exact: the worker's other Python threads' wakeups / token (each a turn of the GIL "
                      "the decode waits out; docs/benchmarks/cpu-gil66)", "–",
                      ", ".join(f"{k} {v['wakeups']:.2f}" for k, v in others.items()) or "none", None))
    wh = _pass(ex, "warm").get("host_us_per_application")
    if hu is not None and wh:  # the host's speed: the same run's warm prefill pass (no decode change touches it)
        L.append(_row("  decode host ÷ the warm prefill pass's host (µs per application): across machines", "–",
                      f"{hu / wh:.2f} ({_f(hu)} ÷ {_f(wh)})", None))
    tc, th = exd.get("triton_compiles"), exd.get("token_host_s") or []
    if tc is not None or th:  # issue 21: no Triton compile inside a timed decode token (MoEStep.warm_kernels at attach)
        L.append(_row("  decode, exact: first token's host ms (median token's) / Triton compiles in the timed tokens",
                      "compiles 0", f"{_f(th[0] * 1e3 if th else None, '{:,.1f}')} "
                      f"({_f(sorted(th)[len(th) // 2] * 1e3 if th else None, '{:,.1f}')}) / {_compiles(tc)}",
                      None if not tc or tc.get("count") is None else tc["count"] == 0))
    ln = (ex.get("profile", {}).get("decode") or {}).get("launches_per_layer")
    L.append(_row("kernel launches / layer, decode, exact", "≤ 60", _f(ln), None if ln is None else ln <= 60))
    names = (ex.get("profile", {}).get("decode") or {}).get("launches_by_name")
    if names:                 # which kernels the count is made of (services/bench/profile.by_name)
        L.append(_row("  of it, by kernel (per layer)", "–", "; ".join(f"`{n}` {c:g}" for n, c in names.items()),
                      None))
    cka = (ex.get("profile", {}).get("decode") or {}).get("copy_kernels_after")
    if cka:                   # the driver's copy kernels in it, by the kernel before each (profile.copy_kernels_after)
        L.append(_row("  of it, copy kernels by the kernel before (per layer)", "–", "; ".join(
            f"`{n}` " + ", ".join(f"{a} {c:g}" for a, c in by.items()) for n, by in cka.items()), None))
    idle = exd.get("disk_idle") or {}
    if "between_ms_per_token" in idle:  # where the exact decode's disk idles (services/bench/disk_idle.py)
        g = exd.get("guess") or {}
        L.append(_row("  decode, exact: disk idle ms/token between tokens / within a token (active)", "–",
                      f"{idle['between_ms_per_token']:.1f} / {idle['within_ms_per_token']:.1f} "
                      f"({idle['active_ms_per_token']:.1f}; busy {_f(exd.get('disk_busy_fraction'), '{:.1%}')})"
                      + ("" if idle.get("gaps_complete", True) else ", gap log incomplete")
                      + (f"; hash ahead {g['hash_ahead_started'] / max(1, exd['tokens']):.1f} reads/token "
                         f"started of {g['hash_ahead'] / max(1, exd['tokens']):.1f} asked"
                         if g.get("hash_ahead") else "; hash ahead off"), None))
        if idle.get("ended_by"):    # the message that ended each idle gap: what the disk waited for
            L.append(_row("  of it, by the message that ended the gap (ms/token between / within)", "–",
                          ended_label(idle), None))
        for where in ("within", "between"):     # the chain of the gaps a layer's message ended (disk_idle.CHAIN)
            if chain_label(idle, where):
                L.append(_row(f"  of it, {where}: " + " / ".join(CHAIN) + " ms per token", "–",
                              chain_label(idle, where), None))
            if gpu_label(idle, where):          # its gpu part cut at the worker's device marks (disk_idle.GPU)
                L.append(_row(f"  of gpu, {where}: " + " / ".join(GPU) + " ms per token", "–",
                              gpu_label(idle, where), None))
    runs = [p for c in (ex, pool) for p in c.get("passes", []) + ([c["decode"]] if c.get("decode") else [])]
    # the target is for layer-major passes and decode; a pass of the standard (token-major) schedule, which the
    # bench runs for comparison, is shown beside it and judged by nothing
    std = [p["bound"]["achieved"] for p in runs if p.get("schedule") == "standard" and p.get("bound")]
    bounds = [p["bound"] for p in runs if p.get("bound") and p.get("schedule") != "standard"]
    ach = [b["achieved"] for b in bounds]
    wrong = sum(bool(b.get("bound_wrong")) for b in bounds)
    L.append(_row("every layer-major pass and decode run, achieved of its bound", "0.8-1.0, bound honest",
                  (f"{min(ach):.2f}-{max(ach):.2f}" + (f", {wrong} bound wrong" if wrong else "")) if ach else "–",
                  None if not ach else (wrong == 0 and min(ach) >= 0.8)))
    if std:
        L.append(_row("  standard-schedule passes (for comparison), achieved of their bound", "–",
                      ", ".join(f"{a:.2f}" for a in std), None))
    peak = r.get("vram", {}).get("peak_bytes")
    L.append(_row("peak VRAM (MiB)", f"≤ {VRAM_TARGET_MIB:,}", _f(None if peak is None else peak / MiB, "{:,.0f}"),
                  None if peak is None else peak / MiB <= VRAM_TARGET_MIB))
    if ex.get("kernel_warmup") or pool.get("kernel_warmup"):   # what attach's steps (warm-ups) put on the GPU
        L.append(_row("  attach VRAM by step, MiB device-wide / torch reserved (exact; pool's re-attach)", "–",
                      f"{attach_vram(ex.get('kernel_warmup'))} ‖ {attach_vram(pool.get('kernel_warmup'))}", None))
    share = pw.get("disk_share")
    L.append(_row("pool: warm repeated 64-token prompt, disk share", "0%", _f(None if share is None else 100 * share,
                                                                              "{:.2f}%"),
                  None if share is None else share == 0))
    tg = pd.get("tg_mean")
    L.append(_row("pool: decode TG (tok/s, 8 layers)", "≥ 60", _f(tg, "{:.2f}"), None if tg is None else tg >= 60))
    pp = pw.get("tok_per_s")
    L.append(_row("pool: warm 64-token PP (tok/s)", "≥ 150", _f(pp), None if pp is None else pp >= 150))
    d = pool.get("divergence") or {}
    L.append(_row("pool: divergence from exact (prompt, teacher-forced)", "measured, beside every pool figure",
                  f"top-1 {d['top1']:.1%}, KL {d['kl']:.4f} nats/token ({d['tokens']} tokens)" if "top1" in d
                  else d.get("skipped", "–"), "top1" in d if pool else None))
    return L + [""]


def disk_split_table(r: dict) -> list[str]:
    """One row per pass and decode run that read from disk: its disk achieved (bound disk_s / seconds; its achieved
    where disk is the limiter) = busy share x rate while busy / the bound's rate x needed / read bytes
    (ceilings.disk_split), the product beside it, and the preadv calls in flight while busy beside the sample's."""
    L = ["## Disk achieved, split (ceilings.disk_split: disk achieved = busy share × rate while busy ÷ bound rate "
         "× needed ÷ read)", "",
         "| case | run | achieved (limiter) | disk achieved = bound disk_s / seconds | busy share = "
         "store_disk_active_s / seconds | rate while busy ÷ bound rate = store_disk_bytes / store_disk_active_s / "
         "disk_bps | needed ÷ read = disk_bytes / store_disk_bytes | product | reads in flight while busy = "
         "store_disk_busy_s / store_disk_active_s | the bound's sample's (pattern, its busy share) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    n = len(L)
    for c in r.get("cases", []):
        for p in c.get("passes", []) + ([dict(c["decode"], label="decode")] if c.get("decode") else []):
            s, b = p.get("disk_split"), p.get("bound") or {}
            if not s:
                continue
            L.append(f"| {c['name']} | {p['label']} | {b['achieved']:.3f} ({b['limiter']}) | "
                     f"{s['disk_achieved']:.3f} | "
                     f"{s['busy_share']:.3f} | {s['busy_rate']:.3f} | {s['needed_share']:.3f} | "
                     f"{s['busy_share'] * s['busy_rate'] * s['needed_share']:.3f} | "
                     f"{s['depth']:.2f} | " + (f"{s['sample_depth']:.2f} ({s['sample_pattern']}, busy "
                                              f"{s['sample_busy_share']:.1%})" if "sample_depth" in s
                                              else f"– ({b.get('disk_source', 'own reads')})") + " |")
    return L if len(L) > n else []


def depth_curve(r: dict) -> str | None:
    """The disk's depth curve line (bench --disk-depths): GB/s at N experts in flight, with the preadv calls in flight
    while busy; None when the run took none."""
    d = r.get("ceilings", {}).get("disk_depths") or []
    if not d:
        return None
    return ("- Disk depth curve (random pattern, N experts in flight: GB/s, reads in flight while busy): "
            + ", ".join(f"N={s['queue']} {s['bps'] / GB:.2f} ({s['depth']:.2f})" for s in d))


def summary(r: dict) -> str:
    L = targets(r) + ["## ds4 summary (issue 21 figures, per case)", "",
         "| case | decode tok/s mean / peak | decode disk share | host µs / application (decode) | "
         "launches / layer (decode / warm) | decode bound tok/s (limiter) | achieved | first token host ms | "
         "Triton compiles (decode; at attach) |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in r.get("cases", []):
        d, prof = c.get("decode") or {}, c.get("profile", {})
        b = d.get("bound", {})
        bt = d["tokens"] / b["bound_s"] if d and b.get("bound_s") else None
        ach = b.get("achieved")
        share = d.get("disk_share")
        name = c["name"] + (f" (APPROXIMATE {c['routing_mode']})" if c.get("routing_mode", "exact") != "exact" else "")
        L.append(f"| {name} | {_f(d.get('tg_mean'), '{:.2f}')} / {_f(d.get('tg_peak'), '{:.2f}')} | "
                 f"{_f(None if share is None else 100 * share, '{:.1f}%')} | {_f(d.get('host_us_per_application'))} | "
                 f"{_f(prof.get('decode', {}).get('launches_per_layer'))} / "
                 f"{_f(prof.get('warm', {}).get('launches_per_layer'))} | {_f(bt, '{:.2f}')} ({b.get('limiter', '–')}) | "
                 f"{'bound wrong (' + _f(ach, '{:.2f}') + ')' if b.get('bound_wrong') else _f(ach, '{:.2f}')} | "
                 f"{_f(d['token_host_s'][0] * 1e3 if d.get('token_host_s') else None, '{:,.1f}')} | "
                 f"{_compiles(d.get('triton_compiles'))}; {_compiles(c.get('attach_triton_compiles'))} |")
    split = disk_split_table(r)
    L += [""] + split if split else []
    v = r.get("vram", {})
    peak, budget = v.get("peak_bytes"), v.get("budget", 0)
    verdict = "–" if peak is None else ("within" if peak <= budget else f"OVER by {(peak - budget) / MiB:,.0f} MiB")
    L += ["", f"- Peak VRAM {_f(None if peak is None else peak / MiB, '{:,.0f}')} MiB device-wide (torch allocated "
          f"{(v.get('torch_max_allocated') or 0) / MiB:,.0f} MiB, reserved {(v.get('torch_max_reserved') or 0) / MiB:,.0f} "
          f"MiB) vs the budget {budget / MiB:,.0f} MiB: {verdict}"
          # who sampled it (services/bench/procs.py Monitor): an NVML child process, or the old in-process thread
          + (f"; sampled by {v['peak_by']}" + (f" ({v['nvml_samples']} samples, NVML - cudaMemGetInfo "
                                          f"{-(v.get('nvml_offset_bytes') or 0) / MiB:+,.0f} MiB)"
                                          if v.get("nvml_samples") else "")
             + (f"; {v['note']}" if v.get("note") else "") if v.get("peak_by") else "")]
    disk = [s["bps"] / GB for s in r.get("ceilings", {}).get("disk", [])]
    if disk:
        L.append(f"- Disk (O_DIRECT) sampled during this run: {min(disk):.2f}-{max(disk):.2f} GB/s over {len(disk)} samples")
    if depth_curve(r):
        L.append(depth_curve(r))
    L.append(f"- Status {r.get('status')}, {r.get('elapsed_s', 0):.0f} s")
    return "\n".join(L) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench_json")
    p.add_argument("--out", help="also write the summary here")
    a = p.parse_args()
    try:
        r = json.loads(Path(a.bench_json).read_text())
    except (OSError, ValueError) as e:
        print(f"ds4_summary: error: cannot read {a.bench_json}: {e}")
        return 2
    md = summary(r)
    print(md, end="")
    if a.out:
        Path(a.out).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
