"""Model hyper-parameters read from GGUF metadata (and cross-checked against tensor shapes by the
reader). One frozen value object that every other module takes instead of the metadata dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from betelgeuse.errors import ModelFormatError, UnsupportedError

# llama.cpp's llama_expert_gating_func_type (the values written as {arch}.expert_gating_func)
GATING_FUNCS = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrtsoftplus"}
DS4_RATIOS = (0, 4, 128)     # per-layer compress ratio: 0 sliding window only, 4 CSA (+indexer), 128 HCA


@dataclass(slots=True, frozen=True)
class Deepseek4Params:
    """The `deepseek4` hyper-parameters beyond ModelConfig (llama.cpp's keys; research note §3.1)."""
    q_lora_rank: int                    # attention.q_lora_rank
    o_groups: int                       # attention.output_group_count
    o_lora_rank: int                    # attention.output_lora_rank
    rope_dim: int                       # rope.dimension_count: RoPE on the last rope_dim dims of each head
    n_shared: int                       # expert_shared_count (the shared expert's width is n_shared * n_ff_exp)
    n_hash_layers: int                  # hash_layer_count: the first layers route by tid2eid[token]
    sliding_window: int                 # attention.sliding_window: keys t-window+1..t
    index_n_heads: int                  # attention.indexer.head_count
    index_head_dim: int                 # attention.indexer.key_length
    index_topk: int                     # attention.indexer.top_k
    hc_mult: int                        # hyper_connection.count (residual streams)
    hc_sinkhorn_iters: int              # hyper_connection.sinkhorn_iterations
    hc_eps: float                       # hyper_connection.epsilon
    compress_ratios: tuple[int, ...]    # attention.compress_ratios[:n_layer], each in DS4_RATIOS
    swiglu_limit: tuple[float, ...]     # swiglu_clamp_exp per layer (routed experts)
    swiglu_limit_shexp: tuple[float, ...]  # swiglu_clamp_shexp per layer (shared expert; default = routed)
    compress_rope_theta: float          # attention.compress_rope_freq_base (CSA/HCA layers)
    rope_scaling: str                   # rope.scaling.type: "none" | "yarn" (compressed layers only)
    rope_factor: float                  # rope.scaling.factor
    rope_orig_ctx: int                  # rope.scaling.original_context_length
    yarn_beta_fast: float               # rope.scaling.yarn_beta_fast
    yarn_beta_slow: float               # rope.scaling.yarn_beta_slow
    routed_scale: float                 # expert_weights_scale
    weights_norm: bool                  # expert_weights_norm



@dataclass(slots=True, frozen=True)
class ModelConfig:
    arch: str               # "qwen3moe"
    n_layer: int            # {arch}.block_count
    n_embd: int             # {arch}.embedding_length
    n_head: int             # {arch}.attention.head_count
    n_head_kv: int          # {arch}.attention.head_count_kv
    head_dim: int           # {arch}.attention.key_length (fallback n_embd // n_head)
    n_ff_exp: int           # {arch}.expert_feed_forward_length (cross-checked against the tensor shape)
    n_expert: int           # read from the ffn_gate_exps tensor shape (cross-checked with {arch}.expert_count)
    n_expert_used: int      # {arch}.expert_used_count
    n_vocab: int            # rows of token_embd.weight
    context_length: int     # {arch}.context_length
    rope_theta: float       # {arch}.rope.freq_base (default 10000.0)
    rms_eps: float          # {arch}.attention.layer_norm_rms_epsilon
    norm_topk_prob: bool    # True for qwen3moe (llama.cpp hard-codes it)
    name: str               # general.name or file stem
    ds4: Deepseek4Params | None = None   # deepseek4 and deepseek41 (the keys V4.1 shares with V4)
    ds41: "Deepseek41Params | None" = None   # deepseek41 only (gguf/ds41layout.py: CSA2 roles, Engram)

    def validate(self, where: str) -> None:
        """Invariants a forward pass relies on; a file that breaks them is malformed, not a bug."""
        checks = (
            (self.n_layer > 0, f"block_count must be positive, got {self.n_layer}"),
            (self.n_embd > 0, f"embedding_length must be positive, got {self.n_embd}"),
            (self.n_head > 0 and self.n_head_kv > 0,
             f"head counts must be positive, got {self.n_head} query / {self.n_head_kv} kv"),
            (self.n_head % max(self.n_head_kv, 1) == 0,
             f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}"),
            (self.head_dim > 0, f"head dimension must be positive, got {self.head_dim}"),
            (0 < self.n_expert_used <= self.n_expert,
             f"expert_used_count {self.n_expert_used} must be in 1..{self.n_expert} (the expert count)"),
            (self.context_length > 0, f"context_length must be positive, got {self.context_length}"),
        )
        for ok, msg in checks:
            if not ok:
                raise ModelFormatError(f"{where}: {msg}")

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv


def _get(meta: dict[str, object], key: str, kind: type, where: str, default: object = None) -> object:
    """meta[key] converted to `kind`; ModelFormatError naming the key when missing or mistyped."""
    v = meta.get(key, default)
    if v is None:
        raise ModelFormatError(f"{where}: missing metadata key {key!r}")
    if isinstance(v, list):
        # Some converters write per-layer arrays (e.g. head_count_kv); we need one value.
        if len(set(v)) != 1:
            raise UnsupportedError(f"{where}: metadata {key!r} varies per layer ({v[:8]}...), which is not supported")
        v = v[0]
    try:
        if kind is int:
            if isinstance(v, float) and not v.is_integer():
                raise ValueError
            return int(v)
        return kind(v)
    except (TypeError, ValueError):
        raise ModelFormatError(f"{where}: metadata {key!r} should be {kind.__name__}, got {v!r}") from None


def get_int(meta: dict[str, object], key: str, where: str, default: int | None = None) -> int:
    """An integer metadata value; ModelFormatError naming the key when missing or mistyped."""
    return _get(meta, key, int, where, default)  # type: ignore[return-value]


# An architecture's config reader (gguf/layouts.py: Layout.config) builds the config from metadata plus the facts only
# tensor shapes know (`n_vocab`, `n_expert`, and `n_ff_exp` when the metadata lacks it); the reader cross-checks
# shapes afterwards. `where` (the file path) prefixes every error message; `stem` is the fallback model name;
# `shapes` ({tensor name: torch shape} of the whole file) is for an architecture whose layer structure is told by
# which optional tensors a layer has (deepseek41's CSA2 roles: gguf/ds41layout.py), unused by the others.

def qwen3moe_config(meta: dict[str, object], *, where: str, stem: str, n_vocab: int, n_expert: int,
                    n_ff_exp: int | None, shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelConfig:
    a, name = "qwen3moe", where
    n_embd = _get(meta, f"{a}.embedding_length", int, name)
    n_head = _get(meta, f"{a}.attention.head_count", int, name)
    head_dim = _get(meta, f"{a}.attention.key_length", int, name, n_embd // n_head if n_head else 0)
    v_dim = _get(meta, f"{a}.attention.value_length", int, name, head_dim)
    if v_dim != head_dim:
        raise UnsupportedError(f"{name}: value_length {v_dim} differs from key_length {head_dim}, which is not supported")
    ff_meta = meta.get(f"{a}.expert_feed_forward_length")
    if ff_meta is None and n_ff_exp is None:
        raise ModelFormatError(f"{name}: missing metadata key '{a}.expert_feed_forward_length'")
    n_ff = _get(meta, f"{a}.expert_feed_forward_length", int, name, n_ff_exp)
    count = meta.get(f"{a}.expert_count")
    if count is not None and int(count) != n_expert:  # type: ignore[call-overload]
        raise ModelFormatError(f"{name}: metadata '{a}.expert_count' is {count} but ffn_gate_exps holds {n_expert} experts")
    cfg = ModelConfig(
        arch=a,
        n_layer=_get(meta, f"{a}.block_count", int, name),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=_get(meta, f"{a}.attention.head_count_kv", int, name, n_head),
        head_dim=head_dim,
        n_ff_exp=n_ff,
        n_expert=n_expert,
        n_expert_used=_get(meta, f"{a}.expert_used_count", int, name),
        n_vocab=n_vocab,
        context_length=_get(meta, f"{a}.context_length", int, name),
        rope_theta=_get(meta, f"{a}.rope.freq_base", float, name, 10000.0),
        rms_eps=_get(meta, f"{a}.attention.layer_norm_rms_epsilon", float, name),
        # llama.cpp's qwen3moe graph always renormalizes the top-k weights; newer converters may
        # write expert_weights_norm, which we honour when present.
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
        name=str(meta.get("general.name") or stem),
    )
    cfg.validate(where)
    return cfg


def _array(meta: dict[str, object], key: str, n: int, kind: type, where: str, default=None) -> tuple:
    """A per-layer array key (a scalar is broadcast) with at least n entries -> tuple of n."""
    v = meta.get(key, default)
    if v is None:
        raise ModelFormatError(f"{where}: missing metadata key {key!r}")
    if not isinstance(v, list):
        v = [v] * n
    if len(v) < n:
        raise ModelFormatError(f"{where}: metadata {key!r} has {len(v)} entries, fewer than block_count {n}")
    try:
        return tuple(kind(x) for x in v[:n])
    except (TypeError, ValueError):
        raise ModelFormatError(f"{where}: metadata {key!r} should hold {kind.__name__}s, got {v[:4]!r}") from None


def deepseek4_config(meta: dict[str, object], *, where: str, stem: str, n_vocab: int, n_expert: int,
                     n_ff_exp: int | None, shapes: Mapping[str, tuple[int, ...]] | None = None,
                     arch: str = "deepseek4", ratios_known: tuple[int, ...] = DS4_RATIOS,
                     hash_default: int | None = None) -> ModelConfig:
    """The keys deepseek4 and deepseek41 share (llama.cpp's V4.1 converter subclasses V4's); `arch` is the key
    prefix, `ratios_known` the compress ratios the architecture has, `hash_default` hash_layer_count when absent."""
    a, name = arch, where
    # block_count includes the MTP (nextn) blocks when a file carries them; the trunk is the layers before
    n_layer = _get(meta, f"{a}.block_count", int, name) - _get(meta, f"{a}.nextn_predict_layers", int, name, 0)
    gating = _get(meta, f"{a}.expert_gating_func", int, name)
    if gating != 4:
        raise UnsupportedError(f"{name}: {a} expects {a}.expert_gating_func = 4 (sqrtsoftplus), "
                               f"got {gating} ({GATING_FUNCS.get(gating, 'unknown')})")
    n_head = _get(meta, f"{a}.attention.head_count", int, name)
    head_dim = _get(meta, f"{a}.attention.key_length", int, name)
    v_dim = _get(meta, f"{a}.attention.value_length", int, name, head_dim)
    if v_dim != head_dim:
        raise ModelFormatError(f"{name}: deepseek4 shares K and V: value_length {v_dim} != key_length {head_dim}")
    n_kv = _get(meta, f"{a}.attention.head_count_kv", int, name, 1)
    if n_kv != 1:
        raise ModelFormatError(f"{name}: {a} has one shared K=V head, got head_count_kv {n_kv}")
    ratios = _array(meta, f"{a}.attention.compress_ratios", n_layer, int, name)
    bad = sorted({r for r in ratios if r not in ratios_known})
    if bad:
        raise UnsupportedError(f"{name}: unknown {a} compress ratio(s) {bad} in {a}.attention.compress_ratios "
                               f"(supported: {', '.join(map(str, ratios_known))})")
    clamp = _array(meta, f"{a}.swiglu_clamp_exp", n_layer, float, name)
    scaling = str(meta.get(f"{a}.rope.scaling.type", "none"))
    if scaling not in ("none", "yarn"):
        raise UnsupportedError(f"{name}: rope scaling {scaling!r} is not supported for deepseek4 (none, yarn)")
    yarn = scaling == "yarn"
    p = Deepseek4Params(
        q_lora_rank=_get(meta, f"{a}.attention.q_lora_rank", int, name),
        o_groups=_get(meta, f"{a}.attention.output_group_count", int, name),
        o_lora_rank=_get(meta, f"{a}.attention.output_lora_rank", int, name),
        rope_dim=_get(meta, f"{a}.rope.dimension_count", int, name),
        n_shared=_get(meta, f"{a}.expert_shared_count", int, name),
        n_hash_layers=_get(meta, f"{a}.hash_layer_count", int, name, hash_default),
        sliding_window=_get(meta, f"{a}.attention.sliding_window", int, name),
        index_n_heads=_get(meta, f"{a}.attention.indexer.head_count", int, name),
        index_head_dim=_get(meta, f"{a}.attention.indexer.key_length", int, name),
        index_topk=_get(meta, f"{a}.attention.indexer.top_k", int, name),
        hc_mult=_get(meta, f"{a}.hyper_connection.count", int, name),
        hc_sinkhorn_iters=_get(meta, f"{a}.hyper_connection.sinkhorn_iterations", int, name),
        hc_eps=_get(meta, f"{a}.hyper_connection.epsilon", float, name),
        compress_ratios=ratios,
        swiglu_limit=clamp,
        swiglu_limit_shexp=_array(meta, f"{a}.swiglu_clamp_shexp", n_layer, float, name, list(clamp)),
        compress_rope_theta=_get(meta, f"{a}.attention.compress_rope_freq_base", float, name),
        rope_scaling=scaling,
        rope_factor=_get(meta, f"{a}.rope.scaling.factor", float, name) if yarn else 1.0,
        rope_orig_ctx=_get(meta, f"{a}.rope.scaling.original_context_length", int, name) if yarn else 0,
        yarn_beta_fast=_get(meta, f"{a}.rope.scaling.yarn_beta_fast", float, name, 32.0),
        yarn_beta_slow=_get(meta, f"{a}.rope.scaling.yarn_beta_slow", float, name, 1.0),
        routed_scale=_get(meta, f"{a}.expert_weights_scale", float, name),
        weights_norm=bool(meta.get(f"{a}.expert_weights_norm", True)),
    )
    count = meta.get(f"{a}.expert_count")
    if count is not None and int(count) != n_expert:  # type: ignore[call-overload]
        raise ModelFormatError(f"{name}: metadata '{a}.expert_count' is {count} but ffn_gate_exps holds {n_expert} experts")
    cfg = ModelConfig(
        arch=a, n_layer=n_layer, n_embd=_get(meta, f"{a}.embedding_length", int, name), n_head=n_head,
        n_head_kv=1, head_dim=head_dim,
        n_ff_exp=_get(meta, f"{a}.expert_feed_forward_length", int, name, n_ff_exp),
        n_expert=n_expert, n_expert_used=_get(meta, f"{a}.expert_used_count", int, name), n_vocab=n_vocab,
        context_length=_get(meta, f"{a}.context_length", int, name),
        rope_theta=_get(meta, f"{a}.rope.freq_base", float, name, 10000.0),
        rms_eps=_get(meta, f"{a}.attention.layer_norm_rms_epsilon", float, name),
        norm_topk_prob=p.weights_norm, name=str(meta.get("general.name") or stem), ds4=p)
    cfg.validate(where)
    checks = (
        (0 < p.rope_dim <= head_dim and p.rope_dim % 2 == 0, f"rope.dimension_count {p.rope_dim} must be even and <= key_length {head_dim}"),
        (p.o_groups > 0 and n_head % p.o_groups == 0, f"output_group_count {p.o_groups} must divide head_count {n_head}"),
        (0 <= p.n_hash_layers <= n_layer, f"hash_layer_count {p.n_hash_layers} must be in 0..{n_layer}"),
        (p.sliding_window > 0, f"sliding_window must be positive, got {p.sliding_window}"),
        (p.hc_mult > 0 and p.hc_sinkhorn_iters > 0, f"hyper_connection count/iterations must be positive"),
        (p.n_shared >= 1, f"expert_shared_count must be >= 1, got {p.n_shared}"),
        (all(r == 0 for r in ratios) or (p.index_topk > 0 and 0 < p.rope_dim <= p.index_head_dim),
         f"indexer top_k {p.index_topk} / key_length {p.index_head_dim} invalid for rope dim {p.rope_dim}"),
    )
    for ok, msg in checks:
        if not ok:
            raise ModelFormatError(f"{where}: {msg}")
    return cfg
