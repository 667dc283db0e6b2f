"""Each architecture's GGUF layout: how its metadata becomes a ModelConfig and which tensors a file must hold.

One layout per architecture (qwen3moe's table here, deepseek4's in ds4layout.py, deepseek41's in ds41layout.py) and
one line in LAYOUTS. The reader (reader.py) validates every file against its architecture's layout, so a missing
tensor or a bad shape is named when the file is opened, not deep inside a pass; the model registry
(model/registry.py) points at it.
Torch-free: the store process opens model files too.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from betelgeuse.errors import ModelFormatError, UnsupportedError
from betelgeuse.gguf import ds4layout, ds41layout
from betelgeuse.gguf.modelconfig import ModelConfig, deepseek4_config, qwen3moe_config

TOKEN_EMBD, OUTPUT_NORM, OUTPUT = "token_embd.weight", "output_norm.weight", "output.weight"

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    arch: str                       # general.architecture
    # (metadata, where=, stem=, n_vocab=, n_expert=, n_ff_exp=, shapes=) -> the checked ModelConfig
    # (gguf/modelconfig.py; shapes = {tensor name: torch shape} of the file)
    config: Callable[..., ModelConfig]
    # per-layer tensor kinds whose absence is named before the config is read (the expert gate/up, separate or
    # fused, are checked for every architecture)
    required: tuple[str, ...]
    # (config, names the file holds) -> every tensor it must hold, (name, torch shape): optional and fused tensors
    # are checked in the form the file has them
    tensors: Callable[[ModelConfig, Container[str]], Iterable[tuple[str, Shape]]]
    int_tensors: tuple[str, ...] = ()   # names' endings of the tensors stored as I32 (the others are float types)
    # an open GGUFModelFile -> `betelgeuse inspect`'s lines of what only this architecture has
    describe: Callable[..., list[str]] = lambda f: []

    def is_int(self, name: str) -> bool:
        return name.endswith(self.int_tensors) if self.int_tensors else False


def blk(layer: int, name: str) -> str:
    """'blk.3.attn_q.weight' for (3, 'attn_q')."""
    return f"blk.{layer}.{name}.weight"


# ---- qwen3moe (llama.cpp's LLM_ARCH_QWEN3MOE) -------------------------------------------------------

QWEN3MOE_REQUIRED = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                     "ffn_norm", "ffn_gate_inp", "ffn_down_exps")


def qwen3moe_tensors(c: ModelConfig, names: Container[str]) -> Iterable[tuple[str, Shape]]:
    """(name, torch shape) of every qwen3moe tensor; output.weight only when the file has it (else tied to the
    embedding), the expert gate/up fused (ffn_gate_up_exps) or separate as the file holds them."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    yield TOKEN_EMBD, (c.n_vocab, c.n_embd)
    yield OUTPUT_NORM, (c.n_embd,)
    if OUTPUT in names:
        yield OUTPUT, (c.n_vocab, c.n_embd)
    for i in range(c.n_layer):
        yield blk(i, "attn_norm"), (c.n_embd,)
        yield blk(i, "attn_q"), (q, c.n_embd)
        yield blk(i, "attn_k"), (kv, c.n_embd)
        yield blk(i, "attn_v"), (kv, c.n_embd)
        yield blk(i, "attn_output"), (c.n_embd, q)
        yield blk(i, "attn_q_norm"), (c.head_dim,)
        yield blk(i, "attn_k_norm"), (c.head_dim,)
        yield blk(i, "ffn_norm"), (c.n_embd,)
        yield blk(i, "ffn_gate_inp"), (c.n_expert, c.n_embd)
        yield blk(i, "ffn_down_exps"), (c.n_expert, c.n_embd, c.n_ff_exp)
        if blk(i, "ffn_gate_up_exps") in names:
            yield blk(i, "ffn_gate_up_exps"), (c.n_expert, 2 * c.n_ff_exp, c.n_embd)
        else:
            yield blk(i, "ffn_gate_exps"), (c.n_expert, c.n_ff_exp, c.n_embd)
            yield blk(i, "ffn_up_exps"), (c.n_expert, c.n_ff_exp, c.n_embd)


# ---- the architectures --------------------------------------------------------------------------------

LAYOUTS: dict[str, Layout] = {
    "qwen3moe": Layout("qwen3moe", qwen3moe_config, QWEN3MOE_REQUIRED, qwen3moe_tensors),
    # deepseek4's other tensors depend on per-layer metadata (compress ratios, hash layers): checked once the
    # config is read
    "deepseek4": Layout("deepseek4", deepseek4_config, ("ffn_down_exps",), lambda c, names: ds4layout.tensors(c),
                        int_tensors=("ffn_gate_tid2eid.weight",)),
    # deepseek41's layer roles (CSA2) are read from which optional tensors a layer has: its config takes `shapes`
    "deepseek41": Layout("deepseek41", ds41layout.deepseek41_config, ("ffn_down_exps",),
                         lambda c, names: ds41layout.tensors(c), describe=ds41layout.describe),
}
SUPPORTED_ARCHS = tuple(LAYOUTS)


def check_arch(meta: dict[str, object], where: str) -> Layout:
    """The layout of general.architecture, which must be one we run."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{where}: missing metadata key 'general.architecture'")
    if arch not in LAYOUTS:
        raise UnsupportedError(f"{where}: architecture {arch!r} is not supported (supported: {', '.join(LAYOUTS)})")
    return LAYOUTS[arch]
