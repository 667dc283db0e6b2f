"""Does a decode token's host time grow with its wait for the disk, at the same work? (gpu-run68, issue 21)

tokens.json: per run (bench_ds4's decode record: token_s = a token's wall, token_host_s = its host time, both s; the
same 64 token ids in every run, so token i is the same work in each) -> for the thread-reader runs, each token's host
and wall less that token's mean over those runs (the work taken out: what is left is the run's disk speed), and their
correlation and slope; the same within each run (token against token: mixes more work with more waiting).

    python3 docs/benchmarks/gpu-run68/host_vs_wait.py
"""

from __future__ import annotations

import importlib.util
import json
import statistics as st
import sys
from pathlib import Path

SKIP = 2            # the first tokens (a first token's own host: graphs replayed the first time, the caches' fill)
ROOT = Path(__file__).resolve().parents[3]


def _summary():
    """deploy/device/ds4_summary.py (a script): its host_wait_fit, which every ds4_summary now prints a row of."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))       # ds4_summary imports services.bench
    spec = importlib.util.spec_from_file_location("ds4_summary", ROOT / "deploy/device/ds4_summary.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def fit(xs, ys) -> tuple[float, float]:
    """-> (correlation, slope dy/dx) of paired samples (ds4_summary.host_wait_fit, none skipped)."""
    return _summary().host_wait_fit(xs, ys, skip=0)


def main() -> int:
    runs = json.loads(Path(__file__).with_name("tokens.json").read_text())
    ids = {json.dumps(r["token_ids"]) for r in runs.values()}
    assert len(ids) == 1, "the runs decoded different tokens: token i is not the same work"
    for name, r in runs.items():
        h, w = r["token_host_s"][SKIP:], r["token_s"][SKIP:]
        c, s = fit(w, h)
        print(f"{name:9} within the run: r {c:+.2f}, {s * 1e3:5.1f} µs host per ms of wall; host "
              f"{r['host_us_per_application']:.1f} µs an application at a bound of {r['bound_tok_s']:.2f} tok/s")
    thread = [n for n in runs if n.endswith("thread")]
    n = len(runs[thread[0]]["token_s"])
    dh, dw = [], []
    for i in range(SKIP, n):
        mh = st.mean(runs[t]["token_host_s"][i] for t in thread)
        mw = st.mean(runs[t]["token_s"][i] for t in thread)
        for t in thread:
            dh.append(runs[t]["token_host_s"][i] - mh)
            dw.append(runs[t]["token_s"][i] - mw)
    c, s = fit(dw, dh)
    print(f"the same token across the thread runs ({', '.join(thread)}): r {c:+.2f}, {s * 1e3:.1f} µs host per ms of "
          "wall more than the token's mean")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
