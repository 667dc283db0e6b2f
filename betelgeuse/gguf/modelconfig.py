"""Model hyper-parameters read from GGUF metadata (and cross-checked against tensor shapes by the
reader). One frozen value object that every other module takes instead of the metadata dict."""

from __future__ import annotations

from dataclasses import dataclass

from betelgeuse.errors import ModelFormatError, UnsupportedError

SUPPORTED_ARCHS = ("qwen3moe",)


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


def check_arch(meta: dict[str, object], where: str) -> str:
    """general.architecture, which must be one we run."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{where}: missing metadata key 'general.architecture'")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(f"{where}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    return arch


def get_int(meta: dict[str, object], key: str, where: str, default: int | None = None) -> int:
    """An integer metadata value; ModelFormatError naming the key when missing or mistyped."""
    return _get(meta, key, int, where, default)  # type: ignore[return-value]


def config_from_metadata(meta: dict[str, object], *, where: str, stem: str, n_vocab: int, n_expert: int,
                         n_ff_exp: int | None) -> ModelConfig:
    """Build the config from metadata plus the facts only tensor shapes know (`n_vocab`, `n_expert`,
    and `n_ff_exp` when the metadata lacks it). The reader cross-checks shapes afterwards.
    `where` (the file path) prefixes every error message; `stem` is the fallback model name."""
    name = where
    a = check_arch(meta, where)
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
