"""Engine configuration: one slotted dataclass, validated once, passed down (nano-vllm's Config).

EngineConfig has no defaults, types or checks of its own: its fields are built from the settings model
(betelgeuse/settings.py, the one place a key is defined). Every key marked there as feeding the engine is one
field, named by its engine name (slots.vram_per_layer -> vram_slots, engine.sub_batch -> sub_batch), with the
key's type, default and check; the help text of each is in settings.py (and `betelgeuse serve --help`). Two
fields differ on purpose: `model_path` has no default (an engine needs a model), and `device` defaults to "cpu"
(a library user gets the CPU; the processes resolve the settings' "auto" in engine_config below).

    cfg = EngineConfig(model_path="m.gguf", vram_slots=5, host_slots=15)   # by hand (tests, scripts)
    cfg = engine_config(settings)                                            # from the file, environment and flags
    engine_settings(cfg)                                                     # back: {(section, key): value}, e.g.
                                                                             # a store child's flags (to_flags)

A hand-built config is held to the same rules as the file: __post_init__ runs every key's own check (a bad value
is a BetelgeuseError naming the field), then the checks across keys.
"""

from __future__ import annotations

import os
from dataclasses import field, make_dataclass
from typing import Any

from betelgeuse.errors import BetelgeuseError
from betelgeuse.settings import KEYS_INFO, Key, Settings

GiB = 1 << 30
MiB = 1 << 20

# EngineConfig field -> the settings key that feeds it, in the file's order
ENGINE_KEYS: dict[str, Key] = {k.engine: k for k in KEYS_INFO if k.engine}
_OWN_DEFAULTS = {"device": "cpu"}       # model_path: required


class _EngineConfig:
    """EngineConfig's behaviour: the checks and the derived values (its fields come from the settings)."""
    __slots__ = ()

    def __post_init__(self):
        for name, key in ENGINE_KEYS.items():
            try:
                setattr(self, name, key.check(getattr(self, name)))
            except ValueError as e:
                raise BetelgeuseError(f"{name}: {e}") from None
        if self.decode_gate == "on" and self.decode_at_hand is False:
            raise BetelgeuseError("decode_gate = 'on' needs decode_at_hand (the gate follows the at-hand group)")
        if self.prefill_chunk != "auto" and self.max_batched_tokens < self.prefill_chunk:
            raise BetelgeuseError(f"max_batched_tokens ({self.max_batched_tokens}) must be >= prefill_chunk "
                                  f"({self.prefill_chunk}): a prefill pass takes whole chunks")

    def chunk_for(self, arch_chunk: int) -> int:
        """The prefill chunk a run uses, in tokens: prefill_chunk as given, or with it auto the architecture's own
        (`arch_chunk`: its model class's prefill_chunk, model/interface.py), at most max_batched_tokens (a prefill
        pass takes whole chunks). The runner resolves it once (worker/runner.py) and runs with the result."""
        if self.prefill_chunk != "auto":
            return self.prefill_chunk
        return min(arch_chunk, self.max_batched_tokens)

    @property
    def prefill_pass_tokens(self) -> int:
        """The most prompt tokens one prefill pass holds while nothing decodes (one whole prompt of up to
        max_context, or several prompts of max_batched_tokens in all): the slot plan reserves its activations."""
        return max(self.max_context, self.max_batched_tokens)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def torch_dtype(self):
        import torch
        if self.dtype == "auto":
            return torch.bfloat16 if self.is_cuda else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


def _field(name: str, key: Key):
    if name == "model_path":
        return name, str
    return name, key.field.annotation, field(default=_OWN_DEFAULTS.get(name, key.default))


EngineConfig = make_dataclass("EngineConfig", [_field(n, k) for n, k in ENGINE_KEYS.items()], bases=(_EngineConfig,),
                              slots=True)
EngineConfig.__module__ = __name__          # pickles, reprs and documents as betelgeuse.config.EngineConfig
EngineConfig.__doc__ = "The engine's configuration; a field per settings key (betelgeuse/settings.py):\n\n" + "\n".join(
    f"    {n:<26} [{k.section}] {k.key}: {k.field.description}" for n, k in ENGINE_KEYS.items())


def engine_kwargs(s: Settings) -> dict[str, Any]:
    """EngineConfig's keyword arguments: every key that feeds the engine, under the engine's field name
    (worker.device still says "auto"; the process resolves it)."""
    return {name: getattr(getattr(s, k.section), k.key) for name, k in ENGINE_KEYS.items()}


def engine_settings(cfg) -> dict[tuple[str, str], Any]:
    """The settings that give `cfg` back: (section, key) -> value for every key that feeds the engine (what a store
    child is told, so that it plans with the worker's own configuration)."""
    return {(k.section, k.key): getattr(cfg, name) for name, k in ENGINE_KEYS.items()}


def resolve_device(device: str, use_torch: bool = True) -> str:
    """'auto' -> 'cuda' or 'cpu'. The store passes use_torch=False: it must not import torch (hundreds of MB
    under the shared MemoryMax) and only needs the answer to size the VRAM tier; it looks for the driver's
    device node instead."""
    if device != "auto":
        return device
    if not use_torch:
        return "cuda" if os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != "" else "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(s: Settings, use_torch: bool = True):
    """The engine's configuration from the settings (both processes derive the same one); only the device is
    resolved here."""
    kw = engine_kwargs(s)
    kw["device"] = resolve_device(kw["device"], use_torch)
    return EngineConfig(**kw)
