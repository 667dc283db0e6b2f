"""Readers for public routing traces and expert-usage profiles (research/data-candidates.md), into what routing_stats.py
takes: a trace (ids [T, L, k], weights or None, sequence starts) or a profile (counts [L, E]).

Traces (token order kept):
- FLAME-MoE CSVs (DynaNDE-Simulator `Sample routing traces/Encoder_Batch_*/Layer_N/*.csv`, from the HF dataset
  CMU-FLAME/FLAME-MoE-Traces): one file per layer, header `layer_id,token_id,expert_0..expert_{E-1}`, one row per
  token holding the router probabilities of its k chosen experts and zeros elsewhere; rows are sequences of
  `seq_len` tokens one after another.
- route JSONL (vLLM-MoE-Logger, lattice and similar loggers): one JSON object per line with a layer, a token index,
  the chosen ids and optionally their weights and a request id; field names vary, so they are parameters.
- Strata `--dump-routing` binary: records (int32 layer, int32 k, k x int32 ids, k x float32 weights), decode steps in
  order; a record of a layer at or below the previous one starts the next token; negative layers are tags, skipped.
Profiles (counts only):
- Krasis heatmaps: JSON {"layer,expert": count} (+ "_metadata").
- Fiddler popularity: JSON {"expert_popularity": [[count per expert] per layer], ...}.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np


def read_flame_csvs(folder: str | Path, k: int, seq_len: int = 64):
    """A folder holding `Layer_N/*.csv` (or the CSV files themselves, each name containing `layerN`) -> (ids [T, L, k]
    by descending probability, weights [T, L, k], sequence starts, the layer numbers in trace order)."""
    folder = Path(folder)
    files = {}
    for p in folder.rglob("*.csv"):
        if "_stats" in p.name:
            continue
        m = re.search(r"Layer_(\d+)", str(p.relative_to(folder))) or re.search(r"layer(\d+)", p.name)
        if m:
            files[int(m.group(1))] = p
    if not files:
        raise ValueError(f"{folder}: no FLAME routing CSVs (Layer_N/*.csv)")
    ids, wts = [], []
    for layer in sorted(files):
        probs = np.loadtxt(files[layer], delimiter=",", skiprows=1)[:, 2:]          # [T, E]
        nz = (probs > 0).sum(1)
        if (nz != k).any():
            raise ValueError(f"{files[layer]}: rows choose {sorted(set(nz.tolist()))} experts, expected {k}")
        top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        ids.append(top)
        wts.append(np.take_along_axis(probs, top, 1))
    ids, wts = np.stack(ids, 1), np.stack(wts, 1)
    return ids, wts, list(range(0, ids.shape[0], seq_len)), sorted(files)


def read_route_jsonl(path: str | Path, layer="layer", token="token_idx", ids="topk_ids", weights="topk_weights",
                     request="req_id") -> tuple[np.ndarray, np.ndarray | None, list[int]]:
    """Route records, one JSON object per line (lines without `ids` are headers, skipped) -> (ids [T, L, k],
    weights or None, sequence starts). Tokens are ordered by (first appearance of the request, token index); every
    token must have a record for every layer that appears."""
    recs = {}
    order: dict = {}
    layers = set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if ids not in d:
                continue
            req = d.get(request, 0)
            order.setdefault(req, len(order))
            key = (order[req], int(d[token]))
            recs.setdefault(key, {})[int(d[layer])] = (d[ids], d.get(weights))
            layers.add(int(d[layer]))
    if not recs:
        raise ValueError(f"{path}: no route records with field {ids!r}")
    layers = sorted(layers)
    keys = sorted(recs)
    missing = next((key for key in keys if len(recs[key]) != len(layers)), None)
    if missing is not None:
        raise ValueError(f"{path}: token {missing[1]} of request #{missing[0]} lacks layers "
                         f"{sorted(set(layers) - set(recs[missing]))}")
    out = np.array([[recs[key][l][0] for l in layers] for key in keys], np.int64)
    has_w = all(recs[key][l][1] is not None for key in keys for l in layers)
    w = np.array([[recs[key][l][1] for l in layers] for key in keys], np.float64) if has_w else None
    starts = [i for i, key in enumerate(keys) if i == 0 or key[0] != keys[i - 1][0]]
    return out, w, starts


def read_strata_dump(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Strata `--dump-routing` records -> (ids [T, L, k], weights [T, L, k]); L = the layers of the first token."""
    data = Path(path).read_bytes()
    tokens, cur, prev, off = [], {}, None, 0
    while off < len(data):
        if off + 8 > len(data):
            raise ValueError(f"{path}: truncated record at byte {off}")
        layer, k = struct.unpack_from("<ii", data, off)
        if k <= 0 or off + 8 + 8 * k > len(data):
            raise ValueError(f"{path}: bad record at byte {off} (layer {layer}, k {k})")
        ids = np.frombuffer(data, "<i4", k, off + 8)
        w = np.frombuffer(data, "<f4", k, off + 8 + 4 * k)
        off += 8 + 8 * k
        if layer < 0:
            continue
        if prev is not None and layer <= prev:
            tokens.append(cur)
            cur = {}
        cur[layer] = (ids, w)
        prev = layer
    if cur:
        tokens.append(cur)
    if not tokens:
        raise ValueError(f"{path}: no routing records")
    layers = sorted(tokens[0])
    full = [t for t in tokens if sorted(t) == layers]
    return (np.array([[t[l][0] for l in layers] for t in full], np.int64),
            np.array([[t[l][1] for l in layers] for t in full], np.float64))


def read_krasis_heatmap(path: str | Path, n_expert: int) -> np.ndarray:
    """{"layer,expert": count} -> counts [L, E] (L = 1 + the largest layer present)."""
    d = json.loads(Path(path).read_text())
    pairs = [(tuple(int(x) for x in key.split(",")), v) for key, v in d.items() if not key.startswith("_")]
    if not pairs:
        raise ValueError(f"{path}: no 'layer,expert' counts")
    counts = np.zeros((1 + max(l for (l, _), _ in pairs), n_expert))
    for (l, e), v in pairs:
        counts[l, e] = v
    return counts


def read_fiddler_popularity(path: str | Path) -> np.ndarray:
    """{"expert_popularity": [[count per expert] per layer]} -> counts [L, E]."""
    return np.array(json.loads(Path(path).read_text())["expert_popularity"], np.float64)
