"""Engine configuration: one slotted dataclass, validated once, passed down (nano-vllm's Config)."""

from __future__ import annotations

from dataclasses import dataclass

from betelgeuse.errors import BetelgeuseError

GiB = 1 << 30
MiB = 1 << 20

SCHEDULES = ("layer_major", "standard")
PREFILL_CHUNK = 64      # tokens: the default position-aligned prefill chunk (engine and reference must agree)


@dataclass(slots=True)
class EngineConfig:
    model_path: str
    device: str = "cpu"                 # "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"                 # compute dtype: "auto" = float32 on CPU, bfloat16 on CUDA
    schedule: str = "layer_major"       # "layer_major" (single pass, overlap) | "standard" (3-token micro-batches, on demand)
    sub_batch: int = 16                 # tokens per expert matmul in layer-major prefill
    micro_batch: int = 3                # tokens per micro-batch in the standard schedule
    vram_slots: int | str = 5           # VRAM hot slots per MoE layer, or "auto"
    host_slots: int | str = 15          # host-only slots per MoE layer (besides the VRAM experts' backing copies), or "auto"
    vram_backing: bool = True           # VRAM experts keep a host copy: a restarted worker refills VRAM from RAM.
                                        # False: VRAM slots add capacity; their experts are (re)read from disk
    staging_slots: int | str = "auto"   # shared staging slots for disk reads in flight / waiting for their copy
    ring_slots: int = 32                # device slots host/disk experts stream into (execution ring: two banks
                                        # of ring_slots/2; a bank is one batch of experts = one kernel launch group)
    kernels: str = "auto"               # expert math: "auto" (triton on CUDA where the quant type allows, else torch),
                                        # "torch" (the reference loop), "triton" (also on the CPU under TRITON_INTERPRET=1)
    cuda_graphs: bool = True            # CUDA: decode steps replay captured graphs (host-dependent layers stay eager)
    decode_consolidate_every: int = 32  # decode tokens between consolidations of the decode's own usage (0 = only at
                                        # the end of a request): a long generation's working set moves into resident tiers
    prefetch: bool = True               # read the next layer's likely experts ahead during prefill
    routing: str = "exact"              # "exact" (the model's top-k) | "resident" (approximate: ranks >= 1 among resident experts)
    vram_budget: int = 12 * GiB         # bytes, for everything the worker puts on the GPU
    memory_max: int | None = None       # bytes for both processes; None = from the cgroup (or unlimited)
    worker_reserve: int | str = "auto"  # host bytes the worker needs outside the arena (torch, CUDA context, dense weights staging)
    max_context: int = 4096             # tokens per sequence (KV cache length)
    max_running: int = 4                # sequences with a live KV cache at once (they decode together, one batch)
    max_queue: int = 16                 # waiting requests beyond which Generate is refused (RESOURCE_EXHAUSTED)
    max_batched_tokens: int = 512       # prompt tokens one prefill pass takes while other sequences decode
                                        # (chunked prefill: a long prompt no longer stalls running decodes), and
                                        # of several prompts prefilled together (prefill_pass_tokens)
    prefill_chunk: int = PREFILL_CHUNK  # tokens: attention/routing run in position-aligned chunks of this size, the
                                        # prefix cache's block size (a prefix hit is then bit-identical to a miss)
    prefix_cache_bytes: int | str = "auto"  # bytes of the device KV prefix cache (0 = off; "auto" = two full
                                        # contexts' KV, at most 512 MiB); the slot plan subtracts it
    read_threads: int = 8               # concurrent preadv calls in the store
    read_request_bytes: int = 4 * MiB   # size of one preadv call
    max_prompt_bytes: int = 256 * 1024  # UTF-8 bytes of prompt text / chat message content, checked before tokenizing
    tokenize_threads: int = 2           # requests tokenized at once (on the RPC threads, never the engine thread)

    def __post_init__(self):
        if self.routing not in ("exact", "resident"):
            raise BetelgeuseError(f"routing must be 'exact' or 'resident', got {self.routing!r}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise BetelgeuseError(f"kernels must be 'auto', 'torch' or 'triton', got {self.kernels!r}")
        if self.decode_consolidate_every < 0:
            raise BetelgeuseError(f"decode_consolidate_every must be >= 0, got {self.decode_consolidate_every}")
        if self.schedule not in SCHEDULES:
            raise BetelgeuseError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name in ("vram_slots", "host_slots", "staging_slots"):
            v = getattr(self, name)
            if isinstance(v, str):
                if v != "auto":
                    raise BetelgeuseError(f"{name} must be a number or 'auto', got {v!r}")
            elif v < 0:
                raise BetelgeuseError(f"{name} must be >= 0, got {v}")
        if self.sub_batch < 1 or self.micro_batch < 1:
            raise BetelgeuseError("sub_batch and micro_batch must be >= 1")
        if self.ring_slots < 2:
            raise BetelgeuseError(f"ring_slots must be >= 2 (copy into one while computing another), got {self.ring_slots}")
        if self.prefill_chunk < 1:
            raise BetelgeuseError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_batched_tokens < self.prefill_chunk:
            raise BetelgeuseError(f"max_batched_tokens ({self.max_batched_tokens}) must be >= prefill_chunk "
                                  f"({self.prefill_chunk}): a prefill pass takes whole chunks")
        if self.prefix_cache_bytes != "auto" and (isinstance(self.prefix_cache_bytes, str) or self.prefix_cache_bytes < 0):
            raise BetelgeuseError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.max_running < 1 or self.max_queue < 0:
            raise BetelgeuseError(f"max_running must be >= 1 and max_queue >= 0, got {self.max_running} / {self.max_queue}")
        if self.max_context < 8:
            raise BetelgeuseError(f"max_context must be >= 8, got {self.max_context}")

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
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise BetelgeuseError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}") from None


def parse_slots(value: str | int) -> int | str:
    """A slot count from a flag or a file: a number >= 0, or 'auto'."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise BetelgeuseError(f"slots must be a number or 'auto', got {value!r}") from None
    if n < 0:
        raise BetelgeuseError(f"slots must be >= 0, got {n}")
    return n
