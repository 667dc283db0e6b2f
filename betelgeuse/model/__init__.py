"""The qwen3moe forward pass in torch (shared by the in-process reference path and the out-of-core
engine), sampling and the in-process generation loop."""

from betelgeuse.model.kv_cache import KVCache
from betelgeuse.model.layers import (ExpertWork, apply_experts, expert_ffn, moe_combine, plan_experts,
                                     run_expert)
from betelgeuse.model.qwen3moe import Qwen3MoeModel, ReferenceModel
from betelgeuse.model.weights import DenseWeights, LayerWeights

__all__ = ["DenseWeights", "ExpertWork", "KVCache", "LayerWeights", "Qwen3MoeModel", "ReferenceModel",
           "apply_experts", "expert_ffn", "moe_combine", "plan_experts", "run_expert"]
