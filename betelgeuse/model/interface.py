"""The model interface: what an architecture gives the runner (worker/runner.py) and its own reference path.

The runner owns the routed experts (their bytes come from slots in three tiers), so a model is not one forward();
it is a per-layer surface that the runner drives around the experts:

    engram_begin(cache, ids, source)                       # EngramModel only (deepseek41): after cache.begin
    x = embed(ids)                                         # ids [T] -> the residual (qwen3moe [T,H], deepseek4 [T,hc,H])
    for layer in range(cfg.n_layer):
        x = attention_block(layer, x, cache, positions)    # appends this layer's state of the T tokens to `cache`
        h, aux = moe_input(layer, x)                       # h [T,H]: the router's and the experts' input
        ids, w = route(layer, h, token_ids, resident)      # [T,k] expert ids (int64) and weights (h's dtype)
        routed = sum_r w_r * expert_{ids_r}(h)             # the runner's (kernels/moe.py), activation expert_act
        x = moe_output(layer, x, aux, h, routed)           # the residual after the MoE block (+ a shared expert)
    logits(x)                                              # [T, n_vocab] float32

`cache` is the model's per-sequence state (new_cache; begin/commit around a pass, truncate, nbytes). Capabilities
are class-level flags that the runner reads (it never guesses with getattr and a default):

  chunked_prefill  a token's state depends only on the tokens up to it: a prompt may be prefilled in
                   position-aligned chunks (model/chunks.py) and resumed after a cached prefix (the prefix cache)
  static_decode    attention_block(..., static=True) is the graph-capturable one-token form (the position in a
                   device tensor, attention over the whole fixed-size cache): CUDA decodes in it, in graphs
  lane_decode      the model is a LaneDecode too: batched decode runs its dense part row-batched over fixed lanes
                   (worker/lanes.py); needs static_decode
  state_grows      grow_cache(state, max_len, via_host) gives a state of more tokens holding the old one's (consumed
                   tensor by tensor; via_host: each through host memory, so the device never holds more than the
                   grown state), and a sequence decoded across the growth gets the same bits as one allocated at
                   the larger size: the worker allocates a sequence's state for what its request can use and grows
                   it when it gets there (worker/kv_manager.py)
  prefix_reuse     how a prompt's state is reused by a later prompt that starts with it (worker/kv_manager.py):
                   "blocks": the state is per token, cut into position-aligned blocks of K/V (worker/prefix_cache.py;
                   needs chunked_prefill); "snapshots": the whole state is copied at a chunk boundary and after the
                   whole prompt (worker/snapshot_cache.py; needs chunked_prefill): snapshot(state) / restore(state,
                   snap), and state.mark(n) / take_mark() for the state as it stood after n tokens, taken by the pass
                   whose chunk ends there; "none": every prompt is prefilled whole
  guess_depth      (an int) the layers decode guesses ahead when `prefetch_depth` is auto (worker/guess.py): the
                   architecture's measured best; the config's prefetch_depth overrides it
  guess_min_hit    (a share) the hit rate a guessing depth needs for its reads ahead when `prefetch_min_hit` is auto
                   (worker/guess.py): the architecture's measured waste budget; the config's value overrides it
  prefill_chunk    (an int, tokens) the chunk of a chunked prefill when `prefill_chunk` is auto (EngineConfig.chunk_for;
                   the reference models' default too): fewer, larger chunks cost fewer launches of the dense front,
                   smaller ones a finer prefix grid (blocks, checkpoints); the config's prefill_chunk overrides it

hash_table() -> the hash-routed layers' expert ids per token on the host ([n_hash, V, k], layers 0 .. n_hash-1 route
by token id alone: deepseek4), or None where no layer does (qwen3moe). With prefetch_hash a decode step reads those
layers' disk experts from its start (worker/moe_step.py hash_ahead).

A model whose file has Engram tables (deepseek41) is an EngramModel too: before its layers, a pass hashes each
sequence's new tokens into table rows, which `source` delivers (the engine: the store, worker/engram_feed.py;
the reference: the file's map, model/engram.py FileRows); a static decode step has them staged into fixed device
buffers before its layers (engram_stage).

A new architecture: a model file with a class of this surface (and its reference: model/reference.py's mixin plus
the class), its GGUF layout (gguf/layouts.py) and one line in model/registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch


@dataclass(slots=True)
class StateSnapshot:
    """A copy of a sequence state's consumed part after `length` tokens (prefix_reuse = "snapshots"): per layer,
    the model's tensors (only the rows that hold something), on the state's device, and what the state keeps on
    the host (small: counted in no device budget). restore() copies it into a fresh state, which then holds the
    same bits as the one it was taken from."""
    length: int                                 # tokens
    layers: list[tuple[torch.Tensor, ...]]      # per layer (the model's order)
    host: Any = None                            # host-side state (deepseek41: the Engram history, int64 numpy)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.layers for t in ts)


@runtime_checkable
class SequenceState(Protocol):
    """A sequence's model state (KV cache, or deepseek4's window and compressed entries)."""
    max_len: int                    # tokens it can hold
    length: int                     # tokens every layer holds

    def begin(self, n_tokens: int) -> torch.Tensor: ...      # a pass appends n_tokens -> their positions [n]
    def commit(self) -> None: ...                            # the pass is done: length += n_tokens
    def truncate(self, n: int) -> None: ...                  # keep the first n tokens (prefix reuse)
    def reset(self) -> None: ...                             # a fresh state's bits in the same tensors and uid
    def nbytes(self) -> int: ...


@runtime_checkable
class MoEModel(Protocol):
    """An architecture's forward pass without its routed experts (module doc: the per-layer surface)."""
    chunked_prefill: ClassVar[bool]
    static_decode: ClassVar[bool]
    lane_decode: ClassVar[bool]
    state_grows: ClassVar[bool]
    prefix_reuse: ClassVar[str]     # "blocks" | "snapshots" | "none" (module doc)
    # the decode guess's depth when `prefetch_depth` is auto: layers ahead guessed (worker/guess.py); config overrides
    guess_depth: ClassVar[int]
    # the hit rate a guessing depth needs for its reads ahead when `prefetch_min_hit` is auto (worker/guess.py)
    guess_min_hit: ClassVar[float]
    # tokens of a prefill chunk when `prefill_chunk` is auto (module doc); config overrides
    prefill_chunk: ClassVar[int]
    cfg: Any                        # gguf.modelconfig.ModelConfig
    device: torch.device
    dtype: torch.dtype              # the compute dtype
    expert_act: tuple[str, float | None]   # the routed experts' activation: ("swiglu", clamp limit or None)

    @classmethod
    def load_dense(cls, f, device, dtype) -> Any: ...         # every weight but the routed experts, from a GGUFModelFile
    def new_cache(self, max_len: int) -> SequenceState: ...
    def grow_cache(self, state, max_len: int, via_host: bool = False) -> SequenceState: ...   # module doc
    def check_ids(self, ids) -> torch.Tensor: ...             # token ids -> LongTensor [T] on the device, or InvalidRequestError
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...
    def attention_block(self, layer: int, x: torch.Tensor, cache, positions: torch.Tensor,
                        static: bool = False) -> torch.Tensor: ...
    def moe_input(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, Any]: ...
    def route(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None,
              resident: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def moe_output(self, layer: int, x: torch.Tensor, aux, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor: ...
    # the decode guess (worker/guess.py): layers layer+1 .. layer+n's routing of x (the residual after layer's
    # attention) -> their expert ids [T, n, k], all n at once, the ids their moe_input + route pick
    def guess_ids(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, n: int) -> torch.Tensor: ...
    def hash_table(self) -> Any: ...                # np.ndarray [n_hash, V, k] or None (module doc)
    def logits(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class LaneDecode(Protocol):
    """attention_block in three parts, so batched decode runs the row-wise part over the rows of all sequences at
    once and the attention per sequence (worker/lanes.py):

        carry, rows = lane_rows(layer, x, positions)     # x [B, ...] one row per lane; rows: a tuple of tensors
        o_i = attend_static(layer, lane_row(rows, i), cache_i, pos_i, lane_row(tables, i), out=o[i:i + 1])
                                                         # -> [1, n_head*head_dim], written into out when given
        x = attn_out(layer, carry, o)                    # o [B, n_head*head_dim]
    """
    # .cos_sin(positions, dtype): the tables lane_rows reads (the lanes keep them alive); flattened, they are the
    # `tables` (the step's, made once) attend_static may read at its lane's position instead of recomputing them
    rope: Any
    # optional LANE_ROWS_FIRST = True: every row of lane_rows is lane-first [B, ...] (lane_row slices dim 0), so the
    # lanes keep a layer's rows side by side in one buffer per dtype and copy them in one launch; optional
    # ROWS_OUT = True: lane_rows(layer, x, positions, out=buffers) writes them there itself (no copy), and
    # TABLES_OUT = True: rope.cos_sin(positions, dtype, out=table buffer) writes the tables there (no stacking)

    def lane_rows(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[Any, tuple]: ...
    def lane_row(self, rows: tuple, i: int) -> tuple: ...
    def attend_static(self, layer: int, rows: tuple, cache, pos: torch.Tensor,
                      tables: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor: ...
    def attn_out(self, layer: int, carry, attn: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class EngramModel(Protocol):
    """Rows of hashed n-gram tables looked up per token before the layers (module doc)."""
    def engram_begin(self, cache, ids, source) -> None: ...    # source.rows(engram index, rows [n, n_cols])
    # a static decode step: each one-token cache's rows into its fixed device buffer (and lanes [n] of n_lanes'
    # buffer), before the layers, so no lookup sits inside a captured graph
    def engram_stage(self, caches, lanes=None, n_lanes: int = 0) -> None: ...


def check_model(model) -> None:
    """The model has the surface and its flags agree with its methods (a new architecture's mistakes, caught when
    the runner starts rather than in the first batched decode)."""
    assert isinstance(model, MoEModel), f"{type(model).__name__} lacks the MoEModel surface (model/interface.py)"
    assert model.prefix_reuse in ("blocks", "snapshots", "none"), model.prefix_reuse
    assert model.prefix_reuse == "none" or model.chunked_prefill, \
        f"{type(model).__name__}: prefix_reuse {model.prefix_reuse!r} needs chunked_prefill"
    assert not model.chunked_prefill or (isinstance(model.prefill_chunk, int) and model.prefill_chunk >= 1), \
        f"{type(model).__name__}: chunked_prefill needs its default prefill_chunk (tokens >= 1)"
    assert model.prefix_reuse != "snapshots" or all(callable(getattr(model, m, None)) for m in ("snapshot", "restore")), \
        f"{type(model).__name__}: prefix_reuse 'snapshots' needs snapshot(state) and restore(state, snap)"
    assert not model.lane_decode or (model.static_decode and isinstance(model, LaneDecode)), \
        f"{type(model).__name__}: lane_decode needs static_decode and the LaneDecode methods"
