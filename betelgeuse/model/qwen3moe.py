"""The qwen3moe forward pass, split into the pieces the out-of-core engine reuses.

`Qwen3MoeModel` owns everything but the routed experts: embedding, attention blocks, the MoE input
norm, routing and the output head. `ReferenceModel` adds experts dequantized on demand from the
file's mmap and runs the whole pass in-process; it is the reference the engine must match bit for
bit (same device and dtype) and the path the CLI uses today.

Math follows transformers' Qwen3MoeForCausalLM and llama.cpp's qwen3moe graph:
  x = x + o(attn(rope(k_norm(k(n))), rope(q_norm(q(n))), v(n)))   n = attn_norm(x)
  x = x + sum_r w_r * expert_{e_r}(ffn_norm(x))                     e, w = top-k of softmax(router)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from betelgeuse.errors import InvalidRequestError, ModelFormatError
from betelgeuse.model.kv_cache import KVCache
from betelgeuse.model.layers import (ExpertWeights, Rope, apply_experts, apply_rope, causal_attention, rms_norm,
                                    static_decode_attention)
from betelgeuse.model.weights import DenseWeights


class Qwen3MoeModel:
    def __init__(self, cfg, dense: DenseWeights):
        assert cfg.n_head % cfg.n_head_kv == 0, (cfg.n_head, cfg.n_head_kv)
        assert 0 < cfg.n_expert_used <= cfg.n_expert, (cfg.n_expert_used, cfg.n_expert)
        self.cfg = cfg
        self.dense = dense
        self.device = dense.token_embd.device
        self.dtype = dense.token_embd.dtype
        self.rope = Rope.create(cfg.head_dim, cfg.rope_theta, self.device)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache.for_config(self.cfg, max_len, self.device, self.dtype)

    def check_ids(self, ids) -> torch.Tensor:
        """Token ids (list or tensor) -> LongTensor [T] on the device; InvalidRequestError if bad."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise InvalidRequestError("no input tokens")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.n_vocab:
            bad = lo if lo < 0 else hi
            raise InvalidRequestError(f"token id {bad} is out of range [0, {self.cfg.n_vocab})")
        return ids.to(self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> x [T,H]. Starts a pass: the RoPE tables are computed again for its positions."""
        self.rope._last = None
        return F.embedding(ids.to(self.device), self.dense.token_embd)

    def attention_block(self, layer: int, x: torch.Tensor, cache: KVCache,
                        positions: torch.Tensor, static: bool = False) -> torch.Tensor:
        """x [T,H] -> x + attn(attn_norm(x)) [T,H]; appends this layer's k/v at `positions` [T].
        static: the graph-capturable decode form (T = 1, positions = cache.pos on the device)."""
        cfg, w = self.cfg, self.dense.layers[layer]
        T, hd = x.shape[0], cfg.head_dim
        n = rms_norm(x, w.attn_norm, cfg.rms_eps)
        # per-head RMSNorm on q and k (before RoPE), heads-first layout [heads, T, hd]
        q = rms_norm(F.linear(n, w.wq).view(T, cfg.n_head, hd), w.q_norm, cfg.rms_eps).transpose(0, 1)
        k = rms_norm(F.linear(n, w.wk).view(T, cfg.n_head_kv, hd), w.k_norm, cfg.rms_eps).transpose(0, 1)
        v = F.linear(n, w.wv).view(T, cfg.n_head_kv, hd).transpose(0, 1)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if static:
            cache.write_static(layer, k, v, positions)
            attn = static_decode_attention(q, cache.k[layer], cache.v[layer], positions)
            return x + F.linear(attn, w.wo)
        end = cache.write(layer, k, v, positions)
        attn = causal_attention(q, cache.k[layer][:, :end], cache.v[layer][:, :end], positions)
        return x + F.linear(attn, w.wo)

    # the routed experts' activation: (name, clamp limit); the engine's expert kernels read it
    expert_act = ("swiglu", None)

    def moe_input(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [T,H] -> (ffn_norm(x) [T,H], the input of router and experts; aux for moe_output: none here)."""
        return rms_norm(x, self.dense.layers[layer].ffn_norm, self.cfg.rms_eps), None

    def moe_output(self, layer: int, x: torch.Tensor, aux, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The residual after the MoE block: x + sum_r w_r expert_r(h) (qwen3moe has no shared expert)."""
        return x + routed

    def route(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None,
              resident: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T,H] -> (ids [T,k] int64, weights [T,k] in h's dtype): softmax over all experts in
        float32, top-k, renormalised when norm_topk_prob (always true for llama.cpp's qwen3moe).

        resident [n_expert] bool turns on the approximate `resident` routing mode (DESIGN.md §3.1, off by
        default): rank 0 is the model's own first choice; ranks 1..k-1 choose only among resident experts
        (non-resident ones only when fewer than k-1 are resident). Not exact: outputs depend on residency."""
        logits = F.linear(h, self.dense.layers[layer].router)                  # [T, n_expert]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if resident is None:
            top, ids = torch.topk(probs, self.cfg.n_expert_used, dim=-1)
        else:
            ids = resident_topk(probs, self.cfg.n_expert_used, resident)
            top = probs.gather(1, ids)
        if getattr(self.cfg, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top.to(h.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T,H] -> logits [T, n_vocab] (float32 whatever the compute dtype)."""
        n = rms_norm(x, self.dense.output_norm, self.cfg.rms_eps)
        return F.linear(n, self.dense.output).float()


class ReferenceModel(Qwen3MoeModel):
    """The in-process path: experts dequantized from the file's mmap each time they are needed."""

    def __init__(self, f, dense: DenseWeights, sub_batch: int = 16, kernels: str = "auto"):
        super().__init__(f.config, dense)
        self.file = f
        self.sub_batch = sub_batch
        self.kernels = kernels          # "auto": Triton expert kernels on CUDA where the quant type allows
        from betelgeuse.gguf.quants import dequantize
        self._dequantize = dequantize

    @classmethod
    def load(cls, path, device="cpu", dtype=torch.float32, sub_batch: int = 16) -> "ReferenceModel":
        from betelgeuse.gguf import GGUFModelFile
        path = Path(path)
        if not path.is_file():
            raise ModelFormatError(f"model file {os.fspath(path)!r} does not exist")
        return cls.from_file(GGUFModelFile.open(path), device, dtype, sub_batch)

    @classmethod
    def from_file(cls, f, device="cpu", dtype=torch.float32, sub_batch: int = 16) -> "ReferenceModel":
        """From an already open GGUFModelFile (dense weights are dequantized now, experts later)."""
        return cls(f, DenseWeights.load(f, device, dtype), sub_batch)

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """(gate [F,H], up [F,H], down [H,F]) of one expert, dequantized on the model's device."""
        parts = self.file.expert_parts(layer, expert)
        g, u, d = (self._dequantize(b.to(self.device), p.qtype, tuple(p.shape), self.dtype)
                   for b, p in zip(self.expert_bytes(layer, expert), parts))
        return g, u, d

    def _containing_tensor(self, layer: int, part) -> str:
        """The merged tensor whose bytes hold `part` (ffn_{kind}_exps, or a fused ffn_gate_up_exps)."""
        for name in (f"blk.{layer}.ffn_{part.kind}_exps.weight", f"blk.{layer}.ffn_gate_up_exps.weight"):
            t = self.file.tensors.get(name)
            if t is not None and t.offset <= part.offset and part.offset + part.nbytes <= t.offset + t.nbytes:
                return name
        raise AssertionError(f"no tensor holds expert part {part}")

    def expert_bytes(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three parts' raw bytes (uint8 CPU tensors), as a slot holds them."""
        out = []
        for part in self.file.expert_parts(layer, expert):
            name = self._containing_tensor(layer, part)
            lo = part.offset - self.file.tensors[name].offset
            out.append(torch.from_numpy(self.file.raw(name)[lo:lo + part.nbytes].copy()))
        return out[0], out[1], out[2]

    def _moe(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sum_r w_r expert_r(h) [T,H]. On CUDA with Q8_0/F16/BF16/F32 experts: the engine's Triton kernels
        over this layer's experts packed in a pool (so the engine matches this bit for bit on the GPU);
        otherwise the torch reference (apply_experts)."""
        parts = self.file.expert_parts(layer, 0)
        qts = [(int(parts[0].qtype), int(parts[2].qtype))]
        if self.device.type == "cuda" and self.kernels != "torch":
            from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts
            if MoEKernels.supports(qts):
                used = torch.unique(ids).tolist()
                pool, starts, base, slot = pack_experts(lambda e: self.expert_bytes(layer, e), used,
                                                        self.cfg.n_expert, self.device)
                mk = MoEKernels("triton", self.cfg.n_expert, self.cfg.n_ff_exp, starts[None], qts, self.sub_batch,
                                act_limit=self.expert_act[1])
                r = mk.route(h, ids, w)
                mk.apply(r, 0, pool, Group(None, base, torch.from_numpy(base).to(self.device)), slot, starts=starts)
                return mk.combine(r)
        return apply_experts(h, ids, w, lambda e: self.expert(layer, e), self.sub_batch)

    @torch.inference_mode()
    def forward(self, ids, cache: KVCache) -> torch.Tensor:
        """ids [T] -> logits [T, n_vocab] float32; appends the T tokens to `cache`."""
        ids = self.check_ids(ids)
        positions = cache.begin(ids.numel())
        x = self.embed(ids)
        for layer in range(self.cfg.n_layer):
            x = self.attention_block(layer, x, cache, positions)
            h, aux = self.moe_input(layer, x)
            top_ids, top_w = self.route(layer, h, ids)
            x = self.moe_output(layer, x, aux, h, self._moe(layer, h, top_ids, top_w))
        cache.commit()
        return self.logits(x)


def resident_topk(probs: torch.Tensor, k: int, resident: torch.Tensor) -> torch.Tensor:
    """probs [T,E] float32, resident [E] bool -> ids [T,k]: the top-1 of all experts, then the k-1 most
    probable among the rest, resident experts ranked before non-resident ones (by a +2 offset: probs <= 1)."""
    first = probs.argmax(dim=-1, keepdim=True)                              # [T,1]
    score = probs + 2.0 * resident.to(probs.dtype)[None, :]
    score = score.scatter(1, first, float("-inf"))                         # rank 0 is taken
    rest = torch.topk(score, k - 1, dim=-1).indices if k > 1 else first[:, :0]
    return torch.cat([first, rest], dim=-1)
