"""The architectures Betelgeuse runs, one line each: ARCHS[general.architecture] -> Arch.

An Arch names the engine model (the MoEModel surface of model/interface.py, without its routed experts), the
in-process reference (the same class plus experts dequantized from the file: model/reference.py), the GGUF layout
(gguf/layouts.py: metadata -> config, tensor names and shapes) and what the store's slot plan must know of a
sequence's state. A new architecture is one model file, one layout table and one line here (docs/architecture.md,
"Architectures").

Torch-free: the store process sizes its slot plan from this table (store/plan.py); the model classes are imported
when first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from betelgeuse.errors import UnsupportedError
from betelgeuse.gguf import ds4layout, ds41layout
from betelgeuse.gguf.layouts import LAYOUTS, Layout
from betelgeuse.gguf.modelconfig import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    from betelgeuse.model.interface import MoEModel


def _kv_bytes(c: ModelConfig, n_tokens: int, dtype_bytes: int) -> int:
    """A per-token K/V cache (model/kv_cache.py KVCache): k and v of every layer and kv head."""
    return n_tokens * c.n_layer * 2 * c.n_head_kv * c.head_dim * dtype_bytes


def _no_scratch(c: ModelConfig, n_tokens: int) -> int:
    return 0


def _compute_dtype(name: str, dtype_bytes: int) -> int:
    return dtype_bytes


def _activations(c: ModelConfig, n_tokens: int, dtype_bytes: int) -> int:
    """A prefill pass's activations (qwen3moe): per token the residual and the routed rows y [k, H] in float32,
    q/k/v and their rotated copies; the last logits row."""
    return (n_tokens * (c.n_embd * (4 + 4 * c.n_expert_used) + (c.n_head + 2 * c.n_head_kv) * c.head_dim * dtype_bytes * 2)
            + c.n_vocab * 4 * 4)


@dataclass(frozen=True, slots=True)
class Arch:
    name: str                       # general.architecture (the key of gguf/layouts.py LAYOUTS too)
    engine: str                     # "module:Class" of the engine model
    reference: str                  # "module:Class" of the reference model
    # (config, tokens, compute dtype bytes) -> bytes of one sequence's state holding that many tokens
    state_bytes: Callable[[ModelConfig, int, int], int]
    # a prefix cache can hold the state (K/V blocks or whole-state snapshots), so the plan budgets one
    # (= the engine class's prefix_reuse != "none"; tests/model/test_model_interface.py keeps them equal)
    prefix_cache: bool = True
    # its entries go to a host tier in the store's memory too (worker/prefix_host.py K/V blocks, worker/snapshot_host.py
    # whole-state snapshots), which outlives the worker
    prefix_host: bool = True
    # (config, context tokens) -> peak float32 attention scratch bytes beyond the per-token activations
    scratch_bytes: Callable[[ModelConfig, int], int] = _no_scratch
    # (tensor name, compute dtype bytes) -> bytes per element of a dense (non-expert) tensor once loaded
    elem_bytes: Callable[[str, int], int] = _compute_dtype
    # (config, tokens, compute dtype bytes) -> peak activation bytes of a prefill pass of that many tokens
    activation_bytes: Callable[[ModelConfig, int, int], int] = _activations

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.name]

    def engine_class(self) -> type[MoEModel]:
        return _load(self.engine)

    def reference_class(self) -> type:
        return _load(self.reference)


ARCHS: dict[str, Arch] = {
    "qwen3moe": Arch("qwen3moe", "betelgeuse.model.qwen3moe:Qwen3MoeModel",
                     "betelgeuse.model.qwen3moe:Qwen3MoeReference", _kv_bytes),
    "deepseek4": Arch("deepseek4", "betelgeuse.model.deepseek4:Deepseek4Model",
                      "betelgeuse.model.deepseek4:Deepseek4Reference", ds4layout.state_bytes,
                      scratch_bytes=ds4layout.attention_scratch_bytes,
                      elem_bytes=ds4layout.dense_elem_bytes, activation_bytes=ds4layout.activation_bytes),
    "deepseek41": Arch("deepseek41", "betelgeuse.model.deepseek41:Deepseek41Model",
                       "betelgeuse.model.deepseek41:Deepseek41Reference", ds41layout.state_bytes,
                       scratch_bytes=ds41layout.attention_scratch_bytes,
                       elem_bytes=ds41layout.dense_elem_bytes, activation_bytes=ds41layout.activation_bytes),
}
assert set(ARCHS) == set(LAYOUTS), (set(ARCHS), set(LAYOUTS))


def _load(where: str) -> type:
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def arch_of(c: ModelConfig) -> Arch:
    """The Arch of a model's config (the reader accepted only architectures of gguf/layouts.py)."""
    a = ARCHS.get(c.arch)
    if a is None:
        raise UnsupportedError(f"architecture {c.arch!r} is not supported (supported: {', '.join(ARCHS)})")
    return a


def engine_model(f, device, dtype) -> MoEModel:
    """The model without its routed experts (the engine brings them from slots), for an open GGUFModelFile."""
    cls = arch_of(f.config).engine_class()
    return cls(f.config, cls.load_dense(f, device, dtype))


def reference_model(path, device="cpu", dtype=None, **kw):
    """The in-process reference model (experts dequantized from the file on demand) for a GGUF path."""
    import torch
    from betelgeuse.gguf.header import read_header
    dtype = torch.float32 if dtype is None else dtype
    arch = None
    try:
        arch = read_header(path).metadata.get("general.architecture")
    except Exception:           # noqa: BLE001 - the model's own loader names the problem
        pass
    # an unreadable or unknown file goes to the first architecture's loader, which names what is wrong with it
    a = ARCHS.get(arch) if isinstance(arch, str) else None
    return (a or next(iter(ARCHS.values()))).reference_class().load(path, device=device, dtype=dtype, **kw)
