"""Every qwen3moe weight except the routed experts, dequantized once onto the compute device.

Shapes are torch order ([out, in] for matrices), as `GGUFModelFile.load_tensor` returns them.
The routed experts (`ffn_{gate,up,down}_exps`) are deliberately absent: they come from the file
(the reference models) or from slots (the out-of-core engine).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from betelgeuse.errors import ModelFormatError, UnsupportedError


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor         # [H]
    wq: torch.Tensor                # [n_head*head_dim, H]
    wk: torch.Tensor                # [n_head_kv*head_dim, H]
    wv: torch.Tensor                # [n_head_kv*head_dim, H]
    wo: torch.Tensor                # [H, n_head*head_dim]
    q_norm: torch.Tensor            # [head_dim]
    k_norm: torch.Tensor            # [head_dim]
    ffn_norm: torch.Tensor          # [H]
    router: torch.Tensor            # [n_expert, H]  (ffn_gate_inp)


@dataclass(slots=True)
class DenseWeights:
    token_embd: torch.Tensor        # [n_vocab, H]
    output_norm: torch.Tensor       # [H]
    output: torch.Tensor            # [n_vocab, H] (token_embd when the file ties them)
    layers: list[LayerWeights]

    @classmethod
    def load(cls, f, device="cpu", dtype=torch.float32) -> "DenseWeights":
        cfg = f.config
        if cfg.arch != "qwen3moe":
            raise UnsupportedError(f"architecture {cfg.arch!r} is not supported by the qwen3moe model")
        names = tensor_names(f)

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in names:
                raise ModelFormatError(f"{cfg.name or 'model'}: tensor {name} is missing")
            t = f.load_tensor(name, device, dtype)
            if tuple(t.shape) != shape:
                raise ModelFormatError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
            return t

        H, hd, V = cfg.n_embd, cfg.head_dim, cfg.n_vocab
        q_dim, kv_dim = cfg.n_head * hd, cfg.n_head_kv * hd
        layers = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            layers.append(LayerWeights(
                attn_norm=get(p + "attn_norm.weight", (H,)),
                wq=get(p + "attn_q.weight", (q_dim, H)),
                wk=get(p + "attn_k.weight", (kv_dim, H)),
                wv=get(p + "attn_v.weight", (kv_dim, H)),
                wo=get(p + "attn_output.weight", (H, q_dim)),
                q_norm=get(p + "attn_q_norm.weight", (hd,)),
                k_norm=get(p + "attn_k_norm.weight", (hd,)),
                ffn_norm=get(p + "ffn_norm.weight", (H,)),
                router=get(p + "ffn_gate_inp.weight", (cfg.n_expert, H)),
            ))
        token_embd = get("token_embd.weight", (V, H))
        output = get("output.weight", (V, H)) if "output.weight" in names else token_embd
        return cls(token_embd=token_embd, output_norm=get("output_norm.weight", (H,)),
                   output=output, layers=layers)

    def nbytes(self) -> int:
        ts = [self.token_embd, self.output_norm] + ([] if self.output is self.token_embd else [self.output])
        for l in self.layers:
            ts += [getattr(l, s) for s in LayerWeights.__slots__]
        return sum(t.numel() * t.element_size() for t in ts)


def tensor_names(f) -> set[str]:
    """Names of the tensors in a GGUFModelFile, whether `.tensors` is a mapping or a list of infos."""
    ts = f.tensors
    if isinstance(ts, Mapping):
        return set(ts)
    return {t if isinstance(t, str) else t.name for t in ts}
