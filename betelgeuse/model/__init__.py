"""The model architectures' forward passes in torch (shared by the in-process reference path and the
out-of-core engine), sampling and the in-process generation loop.

Every architecture has the same method surface (embed / attention_block / moe_input / route / moe_output /
logits, new_cache, check_ids, expert_act); `engine_model` and `reference_model` pick the class from the
file's `general.architecture`, so the engine (worker/runner.py) and the CLI are written once."""

from betelgeuse.model.kv_cache import KVCache
from betelgeuse.model.qwen3moe import Qwen3MoeModel, Qwen3MoeReference
from betelgeuse.model.weights import DenseWeights, LayerWeights

__all__ = ["DenseWeights", "KVCache", "LayerWeights", "Qwen3MoeModel", "Qwen3MoeReference", "engine_model",
           "reference_model"]


def engine_model(f, device, dtype):
    """The model without its routed experts (the engine brings them from slots), for an open GGUFModelFile."""
    if f.config.arch == "deepseek4":
        from betelgeuse.model.deepseek4 import Deepseek4Model
        return Deepseek4Model(f.config, Deepseek4Model.load_dense(f, device, dtype))
    return Qwen3MoeModel(f.config, DenseWeights.load(f, device, dtype))


def reference_model(path, device="cpu", dtype=None, **kw):
    """The in-process reference model (experts dequantized from the file on demand) for a GGUF path."""
    import torch
    from betelgeuse.gguf.header import read_header
    dtype = torch.float32 if dtype is None else dtype
    arch = None
    try:
        arch = read_header(path).metadata.get("general.architecture")
    except Exception:           # let the model's own loader name the problem
        pass
    if arch == "deepseek4":
        from betelgeuse.model.deepseek4 import Deepseek4Reference
        return Deepseek4Reference.load(path, device=device, dtype=dtype, **kw)
    return Qwen3MoeReference.load(path, device=device, dtype=dtype, **kw)
