"""DeepSeek-V4.1's Engram: a hashed n-gram memory added to the residual streams before a few layers' attention
(research note §4.3; NeMo `DeepseekV41NgramHash` / `DeepseekV41Engram`, llama.cpp `build_engram`).

Per token t and Engram layer, on the host with 64-bit integers from the file's metadata (no floats anywhere):
    v_s    = token_map[id[t - s]] for s = 0..N-1, or pad_id once a look-back crosses the sequence start
    roll_s = (v_0 * m_0) ^ ... ^ (v_s * m_s)                        (products < 2^63: checked at load)
    row    = roll_s % prime[c] + offset[c]    for the columns c = (s-1)*heads + h, s >= 1
History is per sequence: the hasher is given the compressed ids of the sequence's previous N-1 tokens, so a
prompt prefilled in pieces, or decoded token by token, hashes exactly as in one pass.

Then the rows' values e [n_cols * key_length], projected and gated into each residual stream h:
    kv = wkv e = [key_0 .. key_{hc-1}, value]                      (each [D])
    dot_h = sum(X_h * q_h * k_h * key_h) / rms(X_h) / rms(key_h) / sqrt(D)
    X_h  += sigmoid(copysign(sqrt(max(|dot_h|, 1e-6)), dot_h)) * value
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F



class NgramHasher:
    """Row ids of every Engram table for a run of tokens (module doc), in numpy uint64."""

    def __init__(self, g):                              # g: gguf.ds41layout.EngramParams
        self.token_map = np.asarray(g.token_map, dtype=np.int64)
        self.mult = np.asarray(g.multipliers, dtype=np.uint64)       # [n_eng, N]
        self.primes = np.asarray(g.primes, dtype=np.uint64)          # [n_eng, n_cols]
        self.offsets = np.asarray(g.offsets, dtype=np.uint64)
        self.pad, self.N, self.heads = int(g.pad_id), int(g.max_ngram), int(g.n_heads)

    def compress(self, ids: np.ndarray) -> np.ndarray:
        """Raw token ids [T] -> compressed ids [T] int64."""
        return self.token_map[np.asarray(ids, dtype=np.int64)]

    def rows(self, hist: np.ndarray, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """hist: compressed ids of the sequence's previous tokens (the last N-1 at most, oldest first);
        ids [T] raw token ids; mask [T] bool (False: a position the n-grams may not cross, NeMo's image tokens)
        -> rows [T, n_eng, n_cols] int64."""
        c = self.compress(ids)
        if mask is not None:
            c = np.where(mask, c, -1)
        seq = np.concatenate([np.asarray(hist, dtype=np.int64)[-(self.N - 1):] if self.N > 1 else [], c])
        k, T = seq.shape[0] - c.shape[0], c.shape[0]
        n_eng, n_cols = self.primes.shape
        out = np.empty((n_eng, T, n_cols), dtype=np.uint64)
        blocked = np.zeros(T, dtype=bool)
        rolling = np.zeros((n_eng, T), dtype=np.uint64)
        for s in range(self.N):
            pos = np.arange(T) + k - s
            src = seq[np.maximum(pos, 0)]
            blocked |= (pos < 0) | (src < 0)
            v = np.where(blocked, self.pad, src).astype(np.uint64)
            rolling ^= v[None, :] * self.mult[:, s:s + 1]
            if s:
                sl = slice((s - 1) * self.heads, s * self.heads)
                out[:, :, sl] = rolling[:, :, None] % self.primes[:, None, sl] + self.offsets[:, None, sl]
        return out.transpose(1, 0, 2).astype(np.int64)


@dataclass(slots=True)
class EngramState:
    """A sequence's Engram state: the compressed ids of its last N-1 tokens, and the rows of the tokens of the
    pass in flight (set by `Deepseek41Model.engram_begin`, consumed by its Engram layers)."""
    hist: np.ndarray                        # int64 [<= keep]
    keep: int                               # N - 1: the history the hash looks back over
    pending: np.ndarray | None = None       # int64 [T, n_eng, n_cols]: rows of the pending tokens
    new: np.ndarray | None = None           # int64 [T]: their compressed ids (history once committed)
    source: object = None                   # rows(engram index, rows [n, n_cols]) -> [n, n_cols, key_length]
    # a one-token pass's rows staged before the layers (Deepseek41Model.engram_stage), so the static decode form
    # reads a fixed device buffer and no host lookup sits inside a captured graph
    vals: torch.Tensor | None = None        # [n_eng, 1, n_cols * key_length] in the compute dtype, on the device
    staged: bool = False                    # vals holds the pending token's rows


def engram_residual(X: torch.Tensor, emb: torch.Tensor, wkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """X [T, hc, D] streams, emb [T, n_cols * key_length] (the rows' values) -> X with the gated memory added
    (module doc; NeMo `DeepseekV41Engram.forward` op for op: norms and gate in float32)."""
    T, hc, D = X.shape
    kv = F.linear(emb.to(wkv.dtype), wkv)                                  # [T, (hc + 1) * D]
    key = kv[:, :hc * D].float().view(T, hc, D)
    value = kv[:, hc * D:].float()
    hidden = X.float()
    w = q_w.float() * k_w.float()
    rstd = torch.rsqrt(hidden.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hidden * w * key).sum(-1) * rstd * D ** -0.5                    # [T, hc]
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hidden + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(X.dtype)


class FileRows:
    """Rows read from the file's map (the in-process reference path; the engine's come from the store, O_DIRECT).
    rows(e, ids [n, n_cols]) -> [n, n_cols, key_length] dequantized on `device` in `dtype`."""

    def __init__(self, f, g, device, dtype):
        from betelgeuse.gguf.quants import dequantize
        self._deq = dequantize
        self.device, self.dtype = device, dtype
        self.tables = [f.info(f"blk.{l}.engram_embd.weight") for l in g.layer_ids]
        self.raw = [f.raw(t.name) for t in self.tables]
        self.key_length = g.key_length
        self.rows_read = 0

    def rows(self, e: int, ids: np.ndarray) -> torch.Tensor:
        t = self.tables[e]
        rb = t.nbytes // t.shape[0]
        flat = ids.reshape(-1)
        self.rows_read += flat.size
        b = self.raw[e].reshape(t.shape[0], rb)[flat]                        # [n * n_cols, rb] (a copy)
        out = self._deq(torch.from_numpy(b).to(self.device), t.qtype, (flat.size, self.key_length), self.dtype)
        return out.view(*ids.shape, self.key_length)
