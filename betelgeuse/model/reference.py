"""The in-process reference path shared by every architecture: experts dequantized from the file's mmap each time
they are needed, the whole pass in this process (no slots, no store). It is what the engine must match bit for bit
on the same device and dtype, and what the tests compare against transformers.

An architecture's reference model (Qwen3MoeReference, Deepseek4Reference) = this mixin + its model class (the
MoEModel surface of model/interface.py, load_dense included).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from betelgeuse.errors import ModelFormatError
from betelgeuse.kernels.torch_moe import ExpertWeights, apply_experts
from betelgeuse.model.chunks import layer_back, layer_front, pass_chunks
from betelgeuse.settings import AUTO


class ReferenceExperts:
    def _init_reference(self, f, sub_batch: int, kernels: str, chunk: int | str | None = AUTO):
        self.file = f
        self.sub_batch = sub_batch
        # position-aligned prefill chunks, as the engine's (EngineConfig.prefill_chunk): auto = the architecture's
        # (its class's prefill_chunk, what a runner with prefill_chunk auto runs); None, and for architectures whose
        # prefill is one chunk: the whole pass at once
        self.chunk = (type(self).prefill_chunk if chunk == AUTO else chunk) if self.chunked_prefill else None
        self.kernels = kernels          # "auto": the engine's Triton expert kernels on CUDA where the type allows
        from betelgeuse.gguf.quants import dequantize
        self._dequantize = dequantize

    @classmethod
    def load(cls, path, device="cpu", dtype=torch.float32, sub_batch: int = 16, kernels: str = "auto",
             chunk: int | str | None = AUTO):
        from betelgeuse.gguf import GGUFModelFile
        path = Path(path)
        if not path.is_file():
            raise ModelFormatError(f"model file {os.fspath(path)!r} does not exist")
        return cls.from_file(GGUFModelFile.open(path), device, dtype, sub_batch, kernels, chunk)

    @classmethod
    def from_file(cls, f, device="cpu", dtype=torch.float32, sub_batch: int = 16, kernels: str = "auto",
                  chunk: int | str | None = AUTO):
        """From an already open GGUFModelFile (dense weights are dequantized now, experts later)."""
        return cls(f, cls.load_dense(f, device, dtype), sub_batch, kernels, chunk)

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

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """(gate [F,H], up [F,H], down [H,F]) of one expert, dequantized on the model's device."""
        parts = self.file.expert_parts(layer, expert)
        g, u, d = (self._dequantize(b.to(self.device), p.qtype, tuple(p.shape), self.dtype)
                   for b, p in zip(self.expert_bytes(layer, expert), parts))
        return g, u, d

    def _moe(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, chunks=None) -> torch.Tensor:
        """sum_r w_r expert_r(h) [T,H], computed as the engine does (so it matches bit for bit): on CUDA with
        experts of a type the kernels read (kinds.TRITON_QTYPES) the Triton kernels over this layer's experts packed
        in a pool, otherwise the
        torch reference (apply_experts); the model's SwiGLU clamp either way (None: plain SwiGLU)."""
        limit = self.expert_act[1]
        parts = self.file.expert_parts(layer, 0)
        qts = [(int(parts[0].qtype), int(parts[2].qtype))]
        if self.device.type == "cuda" and self.kernels != "torch":
            from betelgeuse.kernels.moe import Group, MoEKernels, pack_experts
            if MoEKernels.supports(qts):
                used = torch.unique(ids).tolist()
                pool, starts, base, slot = pack_experts(lambda e: self.expert_bytes(layer, e), used,
                                                        self.cfg.n_expert, self.device)
                mk = MoEKernels("triton", self.cfg.n_expert, self.cfg.n_ff_exp, starts[None], qts, self.sub_batch,
                                act_limit=limit)
                r = mk.route(h, ids, w)
                mk.apply(r, 0, pool, Group(None, base, torch.from_numpy(base).to(self.device)), slot, starts=starts)
                return mk.combine(r)
        return apply_experts(h, ids, w, lambda e: self.expert(layer, e), self.sub_batch, limit=limit, chunks=chunks)

    @torch.inference_mode()
    def forward(self, ids, cache) -> torch.Tensor:
        """ids [T] -> logits [T, n_vocab] float32; appends the T tokens to `cache`."""
        ids = self.check_ids(ids)
        start = cache.length
        positions = cache.begin(ids.numel())
        chunks = pass_chunks(positions, start, self.chunk)
        x = self.embed(ids)
        for layer in range(self.cfg.n_layer):
            x, h, auxs, top_ids, top_w = layer_front(self, layer, x, cache, chunks, ids)
            x = layer_back(self, layer, x, auxs, h, self._moe(layer, h, top_ids, top_w, chunks), chunks)
        cache.commit()
        return self.logits(x)
