"""Per-sequence KV cache: one preallocated k/v buffer per layer, filled left to right."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from betelgeuse.errors import InvalidRequestError


_UIDS = itertools.count(1)


@dataclass(slots=True)
class KVCache:
    k: list[torch.Tensor]           # per layer [n_head_kv, max_len, head_dim]
    v: list[torch.Tensor]           # per layer [n_head_kv, max_len, head_dim]
    max_len: int                    # tokens
    length: int = 0                 # tokens whose k/v are valid in every layer
    _pending: int = field(default=0, repr=False)   # tokens being appended by the current pass
    # identity of the state's tensors for captured decode graphs: kept by reset() (a recycled state keeps its
    # graphs: worker/runner.py new_cache), new when the tensors are (grow)
    uid: int = field(default_factory=lambda: next(_UIDS))
    pos: torch.Tensor | None = field(default=None, repr=False)   # [1] int64 on the device: the static decode position
    _at: list = field(default_factory=list, repr=False)   # per layer: where this pass's next write goes (chunks in order)

    @classmethod
    def create(cls, n_layer: int, n_head_kv: int, head_dim: int, max_len: int,
               device="cpu", dtype=torch.float32) -> "KVCache":
        assert max_len > 0, max_len
        shape = (n_head_kv, max_len, head_dim)
        return cls(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)],
                   v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)],
                   max_len=max_len)

    @classmethod
    def for_config(cls, cfg, max_len: int, device="cpu", dtype=torch.float32) -> "KVCache":
        return cls.create(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, max_len, device, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, n_tokens: int) -> torch.Tensor:
        """Start a pass that appends n_tokens; returns their positions [n_tokens] (int64)."""
        if self.length + n_tokens > self.max_len:
            raise InvalidRequestError(
                f"sequence of {self.length + n_tokens} tokens exceeds the KV cache of {self.max_len} tokens")
        self._pending = n_tokens
        self._at = [self.length] * len(self.k)
        return torch.arange(self.length, self.length + n_tokens, device=self.k[0].device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> int:
        """Store k/v [n_head_kv, T, head_dim] at `positions`: the pass's next T positions of this layer (a pass
        writes a layer whole or chunk by chunk, in order). Returns the number of valid keys for this layer after
        the write."""
        T = k.shape[1]
        start = self._at[layer]
        assert positions.numel() == T, "append only"
        # (the start is checked on the CPU only: reading a CUDA tensor here would sync the stream every layer)
        assert positions.device.type != "cpu" or int(positions[0]) == start, "append only"
        end = start + T
        assert end <= self.length + self._pending and end <= self.max_len, (end, self.length, self._pending)
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        self._at[layer] = end
        return end

    def begin_static(self) -> torch.Tensor:
        """Start a one-token pass in the static form (CUDA decode, graph-capturable): the position lives in a
        device tensor [1] updated in place, so a captured graph reads it at replay time."""
        if self.length + 1 > self.max_len:
            raise InvalidRequestError(f"sequence of {self.length + 1} tokens exceeds the KV cache of {self.max_len} tokens")
        if self.pos is None:
            self.pos = torch.zeros(1, dtype=torch.int64, device=self.k[0].device)
        self.pos.fill_(self.length)
        self._pending = 1
        return self.pos

    def write_static(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k/v [n_head_kv, 1, head_dim] at the device position pos [1] (no host value involved)."""
        self.k[layer].index_copy_(1, pos, k)
        self.v[layer].index_copy_(1, pos, v)

    def commit(self) -> None:
        """End the pass: every layer now holds the appended tokens."""
        self.length += self._pending
        self._pending = 0

    def grow(self, max_len: int, via_host: bool = False) -> "KVCache":
        """A state of `max_len` tokens holding this one's (model.grow_cache): each layer's k/v copied into a larger
        buffer, the positions past the old max_len zeros like a fresh cache's. Consumes this state tensor by tensor
        (grow_rows). A new uid: graphs captured over the old buffers must not replay over these."""
        assert max_len >= self.max_len and self._pending == 0, (max_len, self.max_len, self._pending)
        k = [grow_rows(self.k, l, max_len, 1, via_host) for l in range(len(self.k))]
        v = [grow_rows(self.v, l, max_len, 1, via_host) for l in range(len(self.v))]
        return KVCache(k=k, v=v, max_len=max_len, length=self.length)

    def reset(self) -> None:
        """Back to a fresh state's bits (every row zero, no token) in the same tensors, `pos` and uid: a released state
        recycled for a new sequence replays the decode graphs captured over it (worker/runner.py new_cache)."""
        torch._foreach_zero_(self.k + self.v)
        self.length, self._pending, self._at = 0, 0, []

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (prefix reuse); later k/v are overwritten by the next pass."""
        assert 0 <= n <= self.length, (n, self.length)
        self.length = n
        self._pending = 0


def grow_rows(ts: list, i: int, n: int, dim: int, via_host: bool) -> torch.Tensor:
    """ts[i] (its only reference) grown to n along dim: a new zero tensor with the old one copied into its leading
    part; ts[i] becomes None. The old tensor goes once copied, so a state grown tensor by tensor holds one tensor
    twice at most; via_host: its bytes go to the host first and its device memory before the new tensor is allocated,
    so the device never holds more than the grown state (at the cost of a round trip through host memory)."""
    t, ts[i] = ts[i], None
    shape = list(t.shape)
    old, shape[dim] = shape[dim], n
    dev = t.device
    if via_host:
        t = t.cpu()
    new = torch.zeros(shape, dtype=t.dtype, device=dev)
    new.narrow(dim, 0, old).copy_(t)
    return new
