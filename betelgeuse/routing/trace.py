"""Routing trace files, and the two engine hooks that use them: a recorder (what the router chose) and a replayer
(choices taken from a trace instead of the router).

Format (version 1), little-endian, appendable:
  line 1   `BETELGEUSE-ROUTING-TRACE 1\\n`
  line 2   one JSON object + `\\n`: {"n_layer": L, "n_expert": E, "k": k, "weights": bool, ...provenance}
  then     one record per token, in the order the engine routed the tokens: ids int16 [L, k] (rank order), then,
           if "weights", the routing weights float32 [L, k] (what the model's route() returned)
The token count is (file size - header) / record size; a partial record is an error. Rows of concurrent sequences
interleave in routing order (the engine routes them layer by layer in the same order at every layer).

Recording: `Recorder.wrap(model.route)` returns a route() that records each layer's rows; a token is written (at
flush) once every layer has routed it, so any schedule works as long as each layer sees its rows in token order
(layer-major chunks, one token at a time, micro-batches). Replay: `Replayer.wrap(model.route)` returns a route()
whose ids (and
weights, if recorded; else 1/k each) are the next rows of the trace for that layer, cycling at its end. The router
still runs (same work as exact routing); its choice is discarded. Outputs of a replayed pass are meaningless unless
the trace was recorded from the same model on the same tokens (then they are the recorded run's, bit for bit).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"BETELGEUSE-ROUTING-TRACE 1\n"


@dataclass(slots=True)
class Trace:
    ids: np.ndarray                  # [T, L, k] int64
    weights: np.ndarray | None       # [T, L, k] float32, or None
    header: dict

    @property
    def n_expert(self) -> int:
        return int(self.header["n_expert"])


def _record_dtype(L: int, k: int, weights: bool) -> np.dtype:
    fields = [("ids", "<i2", (L, k))] + ([("w", "<f4", (L, k))] if weights else [])
    return np.dtype(fields)


class TraceWriter:
    """Appends token records to a new trace file (header written at open)."""

    def __init__(self, path: str | os.PathLike, n_layer: int, n_expert: int, k: int, weights: bool = True,
                 **provenance):
        if n_expert > 32767:
            raise ValueError(f"{n_expert} experts do not fit the trace's int16 ids")
        self.header = {"n_layer": n_layer, "n_expert": n_expert, "k": k, "weights": weights, **provenance}
        self.dtype = _record_dtype(n_layer, k, weights)
        self.path = Path(path)
        self.f = open(self.path, "wb")
        self.f.write(MAGIC + json.dumps(self.header).encode() + b"\n")
        self.n_tokens = 0

    def append(self, ids: np.ndarray, weights: np.ndarray | None = None) -> None:
        """ids [T, L, k] (weights [T, L, k] when the file has them)."""
        rec = np.zeros(ids.shape[0], self.dtype)
        rec["ids"] = ids
        if self.header["weights"]:
            assert weights is not None, "this trace records weights"
            rec["w"] = weights
        self.f.write(rec.tobytes())
        self.f.flush()                  # a reader (or a killed process) sees whole forwards
        self.n_tokens += ids.shape[0]

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()


def write_trace(path, ids: np.ndarray, n_expert: int, weights: np.ndarray | None = None, **provenance) -> None:
    T, L, k = ids.shape
    w = TraceWriter(path, L, n_expert, k, weights is not None, **provenance)
    w.append(ids, weights)
    w.close()


def read_trace(path: str | os.PathLike) -> Trace:
    """A trace file -> Trace; ValueError naming what is wrong with a file that is not one."""
    with open(path, "rb") as f:
        magic = f.readline()
        if magic != MAGIC:
            raise ValueError(f"{path}: not a routing trace (expected the line {MAGIC[:-1].decode()!r})")
        try:
            header = json.loads(f.readline())
            L, E, k, has_w = int(header["n_layer"]), int(header["n_expert"]), int(header["k"]), bool(header["weights"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: bad trace header ({e})") from None
        body = f.read()
    dt = _record_dtype(L, k, has_w)
    if len(body) % dt.itemsize:
        raise ValueError(f"{path}: {len(body)} bytes of records is not a whole number of {dt.itemsize}-byte tokens "
                         "(truncated?)")
    rec = np.frombuffer(body, dt)
    ids = rec["ids"].astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"{path}: expert id {int(ids.max() if ids.max() >= E else ids.min())} outside 0..{E - 1}")
    return Trace(ids, rec["w"].copy() if has_w else None, header)


class Recorder:
    """Collects each layer's routed rows and writes whole tokens (every layer routed) to a sink (a TraceWriter, or
    anything with header / append / close). The rows stay where the router made them (no device sync per layer)
    until flush(), which the engine calls after a forward's end sync."""

    def __init__(self, sink):
        self.sink = sink
        self.rows: list[list] = [[] for _ in range(sink.header["n_layer"])]   # per layer: (ids [n, k], weights)

    def wrap(self, route):
        def recording_route(layer, h, token_ids=None, resident=None):
            ids, w = route(layer, h, token_ids, resident)
            self.rows[layer].append((ids.detach().clone(), w.detach().float().clone()))
            return ids, w
        return recording_route

    def flush(self) -> None:
        """Write the tokens every layer has routed; keep the rest."""
        import torch
        ready = min(sum(len(b[0]) for b in blocks) for blocks in self.rows)
        if not ready:
            return
        ids, ws = [], []
        for l, blocks in enumerate(self.rows):
            i, w = torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks])
            ids.append(i[:ready].cpu().numpy())
            ws.append(w[:ready].cpu().numpy())
            self.rows[l] = [(i[ready:], w[ready:])] if len(i) > ready else []
        self.sink.append(np.stack(ids, 1), np.stack(ws, 1))

    def discard(self) -> None:
        """Drop rows not yet written (an abandoned pass routed some layers only)."""
        self.rows = [[] for _ in self.rows]

    def close(self) -> None:
        self.flush()
        pending = [sum(len(b[0]) for b in blocks) for blocks in self.rows]
        self.sink.close()
        if any(pending):
            raise ValueError(f"routing recorder closed with tokens routed by some layers only (rows per layer "
                             f"{pending})")


class Replayer:
    """Drives route() from a trace: layer l's n-th routed row gets the trace's token n (mod its length), counted
    from the position set by begin() (the engine sets a pass's first position: the same prompt replayed twice, cold
    and warm, gets the same choices, and decode goes on where the prompt ended)."""

    def __init__(self, trace: Trace, n_layer: int, n_expert: int, k: int):
        h = trace.header
        if (h["n_layer"], h["n_expert"], h["k"]) != (n_layer, n_expert, k):
            raise ValueError(f"the routing trace is for {h['n_layer']} layers x {h['n_expert']} experts top-{h['k']}; "
                             f"the model has {n_layer} x {n_expert} top-{k}")
        if not len(trace.ids):
            raise ValueError("the routing trace holds no tokens")
        self.trace = trace
        self.cursor = [0] * n_layer
        self.k = k

    def begin(self, position: int) -> None:
        self.cursor = [position] * len(self.cursor)

    def wrap(self, route):
        import torch

        def replayed_route(layer, h, token_ids=None, resident=None):
            ids, w = route(layer, h, token_ids, resident)       # the router's work is still done (same cost)
            n, T = ids.shape[0], len(self.trace.ids)
            rows = (self.cursor[layer] + np.arange(n)) % T
            self.cursor[layer] += n
            rids = torch.from_numpy(self.trace.ids[rows, layer]).to(ids.device, ids.dtype)
            if self.trace.weights is not None:
                rw = torch.from_numpy(self.trace.weights[rows, layer]).to(w.device, w.dtype)
            else:
                rw = torch.full_like(w, 1.0 / self.k)
            return rids, rw
        return replayed_route
