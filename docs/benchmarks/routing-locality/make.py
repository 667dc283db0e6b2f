"""Fill the table of ../routing-locality.md and write public.json from the public traces and profiles, the published figures
and our synthetic routers' measurements (synth.json, from measure_synth.py), all through betelgeuse/routing_stats.py.

    .venv/bin/python docs/benchmarks/routing-locality/make.py SOURCES_DIR

SOURCES_DIR holds the public files (not committed: only the statistics derived from them are), from git snapshots
of the public repositories (research/data-candidates.md says what each is):
  flame/Layer_N/*.csv          Akash-N-Pai/DynaNDE-Simulator f274466 `Sample routing traces/Encoder_Batch_0-32/`
  krasis_qwen235b.json         brontoguana/krasis 8b2df14 tests/qwen235b_heatmap.json (SSPL-1.0: statistics only)
  krasis_codernext.json        brontoguana/krasis 7acb5fb tests/coder_next_heatmap.json (SSPL-1.0: statistics only)
  fiddler_instruct_ccs.json    efeslab/fiddler 5e5ed67 benchmarks/results/popularity/mixtral_8x7b_instruct/
                               expert_popularity_college_computer_science.json (Apache-2.0)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from betelgeuse.routing import public as P
from betelgeuse.routing_stats import profile_stats, trace_stats

HERE = Path(__file__).resolve().parent
SHARES = (0.125, 0.25, 0.5)
LRU = (0.2, 0.4, 0.6)

# Figures quoted by their projects (research/data-candidates.md §4), not recomputed here.
PUBLISHED = [
    {"label": "Qwen3-30B-A3B, decode (128 experts, top-8)", "source": "kekzl/imp PR #1359",
     "workload": "3 prompts x 512 decode tokens", "repeat_next": 0.45, "within_8": 0.80, "reuse_median": 2,
     "lru": {0.4: "90.0-95.3%"}},
    {"label": "Qwen3-30B-A3B, decode", "source": "WestWaters/pollard-weights 6313d21 profiles/qwen3-30b-a3b.json "
     "(Apache-2.0): its cache_curve = the hottest 16/32/64 experts per layer", "workload":
     "6 prompts x ~2000 decode tokens, T 0.8, merged (per prompt: top-25% 70-78%)",
     "top_share": {0.125: 0.4293, 0.25: 0.6920, 0.5: 0.9303}},
    {"label": "Qwen3-30B-A3B, rank weights", "source": "BELLS docs", "workload": "mean normalised router weight",
     "rank_weight": [0.229, 0.170, 0.139, 0.118, 0.102, 0.089, 0.080, 0.073]},
    {"label": "Qwen3.8-Flash-Next (512 experts, top-10)", "source": "kekzl/imp PR #2061",
     "workload": "300 decode tokens, layer 0", "top_share": {0.125: 0.41},
     "lru": {0.18: "43.5%", 0.36: "62.0%", 0.54: "72.0%", 0.73: "78.9%"}},
]


def _distinct_layers(ids: np.ndarray, layers: list[int]):
    """FLAME's 25 layer folders hold 8 distinct traces repeated (the 290M model has 8 MoE layers): keep the first of
    each."""
    keep = []
    for l in range(ids.shape[1]):
        if not any((np.sort(ids[:, l], 1) == np.sort(ids[:, m], 1)).all() for m in keep):
            keep.append(l)
    return ids[:, keep], [layers[l] for l in keep]


def public(src: Path) -> dict:
    out = {}
    ids, w, starts, layers = P.read_flame_csvs(src / "flame", k=6)
    ids, layers = _distinct_layers(ids, layers)
    out["flame"] = {"label": "FLAME-MoE-290M (64 experts, top-6)", "source": "Akash-N-Pai/DynaNDE-Simulator f274466 "
                    "(from HF CMU-FLAME/FLAME-MoE-Traces, Apache-2.0)", "workload": "pretraining text, 32 sequences x "
                    f"64 tokens (prefill), distinct layers {layers}",
                    "stats": trace_stats(ids, 64, weights=w[:, :len(layers)], starts=starts)}
    for key, f, E, label, workload in (
            ("krasis_235b", "krasis_qwen235b.json", 128, "Qwen3-235B-A22B (128 experts, top-8)",
             "155 decode tokens, layers 0-31 (brontoguana/krasis 8b2df14, SSPL-1.0: statistics only)"),
            ("krasis_coder", "krasis_codernext.json", 512, "Qwen3-Coder-Next (512 experts, top-10)",
             "~10K-token prefill + decode, layers 0-23 (brontoguana/krasis 7acb5fb)")):
        out[key] = {"label": label, "source": "Krasis heatmap (per-call expert counts)", "workload": workload,
                    "stats": profile_stats(P.read_krasis_heatmap(src / f, E))}
    out["fiddler"] = {"label": "Mixtral-8x7B-Instruct (8 experts, top-2)", "source": "efeslab/fiddler 5e5ed67 "
                      "(Apache-2.0)", "workload": "MMLU college CS, prefill token counts",
                      "stats": profile_stats(P.read_fiddler_popularity(src / "fiddler_instruct_ccs.json"))}
    return out


def _p(x, digits=0):
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _n(x):
    return "–" if x is None else f"{x:g}"


def _at(d: dict, f: float):
    """d[f], whether d came from Python (float keys) or from JSON (string keys)."""
    return d.get(f, d.get(str(f)))


def row(label, workload, st=None, extra=None) -> str:
    """One table row from trace_stats / profile_stats (or a published dict in `extra`)."""
    o = st["overall"] if st else {}
    e = extra or {}
    tok = f"{st['n_tokens']} x {st['n_layer']}" if st and "n_tokens" in st else (
        f"{st['selections_per_layer']:.0f} sel. x {st['n_layer']}" if st else "–")
    rep = _p(o.get("repeat_next", e.get("repeat_next")))
    w8 = _p(o.get("within_8", e.get("within_8")))
    med = _n(o.get("reuse_median", e.get("reuse_median")))
    p80 = _n(o.get("reuse_p80")) if st and "n_tokens" in st else "–"
    lru = " / ".join(_p(_at(o["lru_hit"], f)) for f in LRU) if "lru_hit" in o else (
        ", ".join(f"{int(f * 100)}%: {v}" for f, v in e["lru"].items()) if "lru" in e else "–")
    shares = o.get("top_share") or e.get("top_share") or {}
    top = " / ".join(_p(_at(shares, f)) for f in SHARES)
    gini = f"{o['gini']:.2f}" if "gini" in o else "–"
    rw = o.get("rank_weight", e.get("rank_weight"))
    rws = " ".join(f"{x:.3f}" for x in rw[:3]) + f" … {rw[-1]:.3f}" if rw else "–"
    return f"| {label} | {workload} | {tok} | {rep} | {w8} | {med} / {p80} | {lru} | {top} | {gini} | {rws} |"


MARK = ("<!-- table: make.py -->", "<!-- end of table -->")
HEAD = ("| Routing | Workload | Tokens x layers | Repeat at next token | Within 8 tokens | Reuse distance median / p80 "
        "| LRU hit at 20 / 40 / 60% residency | Top 12.5 / 25 / 50% share | Gini | Mean weight by rank |\n"
        "|---|---|---|---|---|---|---|---|---|---|")


def main(src: str) -> None:
    pub = public(Path(src))
    (HERE / "public.json").write_text(json.dumps(pub, indent=1))
    synth = json.loads((HERE / "synth.json").read_text())
    rows = [row(f"**{p['label']}** ({p['source']})", p["workload"], extra=p) for p in PUBLISHED]
    rows += [row(f"**{p['label']}** ({p['source']})", p["workload"], p["stats"]) for p in pub.values()]
    for label, s in synth.items():
        hashed = s.get("hash_layers", 0)
        for part, what in (("prompt512", "random 512-token prompt"), ("decode256", "greedy decode, 256 tokens "
                           f"({s['decode_distinct_tokens']} distinct)")):
            rows.append(row(f"ours: {label}", what + (" (all layers)" if hashed else ""), s[part]))
            if hashed:
                rows.append(row(f"ours: {label}", what + f" (router layers; {hashed} hash layers left out)",
                                s[part + "_routed_layers"]))
    table = HEAD + "\n" + "\n".join(rows)
    doc = HERE.parent / "routing-locality.md"
    text = doc.read_text()
    a, b = text.index(MARK[0]) + len(MARK[0]), text.index(MARK[1])
    doc.write_text(text[:a] + "\n" + table + "\n" + text[b:])
    print(table)


if __name__ == "__main__":
    main(sys.argv[1])
