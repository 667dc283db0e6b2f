"""The slot plan: how many expert slots of each tier, and whether they fit the budgets.

Computed once, by the store at start-up, from the model file, the configuration and the cgroup;
sent to the worker as JSON when it attaches. A configuration that cannot fit raises BudgetError with
the numbers, before any memory is touched (invariant 3: refused, never OOM-killed).

Per MoE layer: `n_vram` hot slots in the worker's VRAM, plus `n_host` host-only slots: `n_vram + n_host` distinct
experts resident. With `vram_backing` each VRAM expert also keeps a host copy (a restarted worker refills VRAM from
RAM, not disk) at the cost of `n_vram` host slots; `vram_backing = auto` keeps the copies only where they cost no
resident expert (no memory limit, or the memory holds every expert beside them) and otherwise gives their RAM to the
host tier. Disk experts pass through
`n_staging` shared staging slots. Beside the arena, the store holds `prefix_host_bytes` for the prefix cache's
host tier (worker/prefix_host.py), planned before the host slots and counted in the same memory budget.

Before any slot: `max_running` (the sequences whose KV the worker reserves, each a full `max_context`), as
configured, or `auto` = the most of 1..MAX_RUNNING_AUTO whose KV and decode graphs leave the VRAM budget room for a
minimum of VRAM expert slots per layer (plan_running).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field


from betelgeuse.config import GiB, MiB, EngineConfig
from betelgeuse.errors import BudgetError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.kernels import mma_pack
from betelgeuse.kernels.kinds import tile_plan
from betelgeuse.model.registry import arch_of
from betelgeuse.store.layout import ArenaLayout, SlotLayout, round_down

HEADROOM = 256 * MiB            # left free in the cgroup for page tables, sockets, the unexpected
# auto staging: one layer's misses on demand + the next layer's read ahead (2 x the non-resident experts, <= 512
# slots), but in BYTES at most 1 GiB (~0.6 s of reads at 1.8 GB/s keeps the disk's queue full) and at most 1/8 of the
# memory left for the arena: with V4-Flash's 13-19 MB experts 512 slots were 7-10 GB, and the host tier got nothing
STAGING_AUTO_MAX_BYTES = 1 * GiB
STAGING_AUTO_FREE_SHARE = 8
# VRAM the CUDA context and torch's allocator take beyond tensors (767 MiB measured on an H200). A planning figure
# only: what lies outside torch grows with each kernel variant launched (modules, the driver's local-memory
# reservation), so the worker measures it after attach's warm-ups and trims the VRAM tier where this was short
# (worker/vram_fit.py; gpu-run45-serve's service peaked 202 MiB over its budget with it)
CUDA_CONTEXT_BYTES = 1 * GiB
# VRAM of one running sequence's captured decode graphs (worker/lanes.py: its attention graph per layer, their private pool and
# their instantiated kernel nodes); with 8 sequences replaying them device-wide use went 158 MiB higher (docs/benchmarks/gpu-agents3)
GRAPHS_BYTES_PER_SEQ = 32 * MiB
# the Triton expert kernels' split-K partials: at most kernels/triton_moe.WS_LIMIT (64 MiB) per stream, and two
# streams hold one (the eager stream and the graph-capture stream); counted on CUDA with the activations
SPLITK_WORKSPACE_BYTES = 2 * 64 * MiB
# max_running = auto: at most this many sequences (8 clients were where the aggregate decode rate had flattened on
# the bench geometry, docs/scaling.md); fewer where their KV would leave the VRAM tier under its minimum
MAX_RUNNING_AUTO = 8


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB ({n} bytes)"


def mib_text(n: int) -> str:
    """Bytes for a reader: "1,173 MiB", "8.00 MiB", "24 KiB"."""
    return f"{n / MiB:,.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / 1024:,.0f} KiB"


_mib = mib_text          # the short name in this module


@dataclass(slots=True)
class SlotPlan:
    model_path: str
    n_layer: int
    n_expert: int
    n_vram: int                 # VRAM hot slots per layer
    n_host: int                 # host-only slots per layer
    n_staging: int              # shared staging slots
    part_max: tuple[int, int, int]   # largest gate/up/down part in bytes, over all layers
    vram_fixed: int             # estimated worker VRAM outside hot slots (weights, KV, ring, activations)
    worker_reserve: int         # host bytes the worker needs outside the arena
    memory_limit: int | None    # bytes for both processes (None = unlimited)
    notes: list[str] = field(default_factory=list)   # why: how each auto tier was sized, what capped it
    vram_backing: bool = True   # VRAM experts keep a host backing slot
    prefix_host_bytes: int = 0  # the prefix cache's host tier: a memfd beside the arena (0 = none)
    requested: tuple[str, str] = ("auto", "auto")     # vram_slots, host_slots as configured ("auto" or a count)
    vram_budget: int = 0        # bytes everything on the GPU may use (the budget the VRAM tier was sized from)
    vram_parts: dict = field(default_factory=dict)    # vram_fixed by part (VRAM_PARTS), bytes
    memory_source: str = "none"  # where memory_limit came from: "cgroup memory.max" | "memory_max" | "none"
    memory_in_use: int = 0      # bytes the cgroup held when the plan was made (counted against the limit)
    engram: dict | None = None  # the Engram rows' region (store/engram.EngramLayout.to_dict), None: no Engram
    vram_backing_requested: str = "true"   # as configured: "auto", "true" or "false"
    max_running: int = 8        # sequences whose KV (and decode graphs) vram_fixed reserves: the worker runs this many
    max_running_requested: str = "8"       # as configured: "auto" or a count
    # the worker's trim of the VRAM tier at attach, by measurement (worker/vram_fit.py VramFit.record: the measured
    # bytes outside torch's allocator vs the CUDA context allowance, slots per layer before -> after), None: untrimmed
    vram_trim: dict | None = None

    @property
    def resident_per_layer(self) -> int:
        """Distinct experts resident per layer (VRAM and host tiers; a backing copy is not another expert)."""
        return self.n_vram + self.n_host

    @property
    def host_per_layer(self) -> int:
        """Host slots per layer in the arena: the host tier, plus the VRAM tier's backing copies."""
        return self.n_host + (self.n_vram if self.vram_backing else 0)

    @property
    def slot(self) -> SlotLayout:
        return SlotLayout.for_parts(tuple(self.part_max))

    @property
    def layout(self) -> ArenaLayout:
        return ArenaLayout(self.n_layer, self.n_expert, self.host_per_layer, self.n_staging, self.slot,
                           engram_bytes=self.engram_layout.nbytes if self.engram else 0)

    @property
    def engram_layout(self):
        """The Engram region (store/engram.EngramLayout), placed after the staging slots; None without Engram."""
        if not self.engram:
            return None
        from betelgeuse.store.engram import EngramLayout
        lay = EngramLayout.from_dict(self.engram)
        base = ArenaLayout(self.n_layer, self.n_expert, self.host_per_layer, self.n_staging, self.slot).engram_base
        return lay if lay.base == base else EngramLayout.from_dict({**self.engram, "base": base})

    @property
    def arena_bytes(self) -> int:
        return self.layout.total_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory the store holds: the arena and the prefix cache's host tier."""
        return self.arena_bytes + self.prefix_host_bytes

    @property
    def vram_slot_bytes(self) -> int:
        return self.n_layer * self.n_vram * self.slot.slot_bytes

    @property
    def staging_bytes(self) -> int:
        return self.n_staging * self.slot.slot_bytes

    def describe(self) -> dict:
        """What the plan chose and the budgets it came from, flat (the store's "plan" log line, /v1/models
        meta.plan, the gRPC ModelInfo.plan): slots per layer and as requested, bytes of each VRAM part, the arena,
        the budgets, and `why` (how each auto tier was sized)."""
        parts = {f"{k}_bytes": self.vram_parts.get(k, 0) for k in VRAM_PARTS}
        return {"vram_slots": self.n_vram, "host_slots": self.n_host, "staging_slots": self.n_staging,
                "vram_slots_requested": str(self.requested[0]), "host_slots_requested": str(self.requested[1]),
                "vram_backing": self.vram_backing, "vram_backing_requested": self.vram_backing_requested,
                "resident_experts_per_layer": self.resident_per_layer, "slot_bytes": self.slot.slot_bytes,
                "vram_slot_bytes": self.vram_slot_bytes, **parts, "vram_fixed_bytes": self.vram_fixed,
                "vram_budget_bytes": self.vram_budget, "arena_bytes": self.arena_bytes,
                "staging_bytes": self.staging_bytes, "prefix_host_bytes": self.prefix_host_bytes,
                "worker_reserve_bytes": self.worker_reserve,
                "memory_limit_bytes": self.memory_limit, "memory_limit_source": self.memory_source,
                "memory_in_use_bytes": self.memory_in_use, "max_running": self.max_running,
                "max_running_requested": self.max_running_requested, "why": "; ".join(self.notes),
                "vram_trim": trim_text(self.vram_trim)}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SlotPlan":
        d = json.loads(text)
        d["part_max"] = tuple(d["part_max"])
        d["requested"] = tuple(d.get("requested", ("auto", "auto")))
        return cls(**d)


def trim_text(t: dict | None) -> str:
    """A VRAM trim (SlotPlan.vram_trim) in words: "16 -> 14 VRAM slots per layer: measured 1,364 MiB outside
    torch's allocator (the plan allowed 1,024 for the CUDA context), projected 12,490 MiB over the budget 12,288";
    "" untrimmed."""
    if not t:
        return ""
    txt = f"{t['slots_before']} -> {t['slots_after']} VRAM slots per layer"
    if "non_torch" not in t:
        return txt
    return (f"{txt}: measured {_mib(t['non_torch'])} outside torch's allocator (the plan allowed "
            f"{_mib(t['allowance'])} for the CUDA context), projected {_mib(t['projected'])} over the VRAM "
            f"budget {_mib(t['budget'])}")


def vram_floor(vram_slots: str, n_expert_used: int, n_expert: int) -> int:
    """The fewest VRAM expert slots per layer a plan may leave (plan_running's `least`, the worker's trim's floor:
    worker/vram_fit.py): the configured vram_slots, or with vram_slots = auto the model's top-k (at most n_expert)."""
    return min(n_expert_used if str(vram_slots) == "auto" else int(vram_slots), n_expert)


def dense_bytes(f: GGUFModelFile, dtype_bytes: int) -> int:
    """Bytes of every non-expert tensor once loaded: the compute dtype, or what the architecture keeps wider
    (model/registry.py Arch.elem_bytes: deepseek4's float32 norms / mHC / sinks, int64 tid2eid)."""
    elem = arch_of(f.config).elem_bytes
    n = 0
    for t in f.tensors.values():
        if "_exps." in t.name or ".engram_embd." in t.name:      # experts and Engram tables stay on disk
            continue
        elems = 1
        for s in t.shape:
            elems *= s
        n += elems * elem(t.name, dtype_bytes)
    return n


PREFIX_CACHE_AUTO_MAX = 512 * MiB


def prefix_cache_bytes(cfg: EngineConfig, c, dt: int) -> int:
    """Bytes of the KV prefix cache: the configured size, or "auto" = two full contexts' KV (at most 512 MiB);
    0 for architectures whose state no prefix cache holds (model/registry.py Arch.prefix_cache)."""
    arch = arch_of(c)
    if not arch.prefix_cache:
        return 0
    if cfg.prefix_cache_bytes != "auto":
        return int(cfg.prefix_cache_bytes)
    return min(PREFIX_CACHE_AUTO_MAX, 2 * arch.state_bytes(c, cfg.max_context, dt))


# auto: the host tier holds 2 device caches' worth of blocks, but at most 1/16 of the memory left free for the
# expert slots. On the benchmark geometry (96 KiB of KV per token in bfloat16) the device cache is 512 MiB (~10
# prompts of 512 tokens) and this tier ~600 MiB of a 12G cgroup (~13 more): about two dozen such prompts kept in all,
# while the 600 MiB it no longer takes (1/8 took 1.2 GiB) holds 2-3 more experts per layer (243 MB a slot per layer)
PREFIX_HOST_AUTO_DEVICE_FACTOR = 2
PREFIX_HOST_AUTO_FREE_SHARE = 16


def prefix_host_bytes(cfg: EngineConfig, c, dt: int, free: int | None) -> int:
    """Bytes of the prefix cache's host tier (a multiple of 4 KiB): the configured size, or "auto" = 2 x the device
    cache, at most 1/16 of `free` (the host memory left for the arena; None: no limit); 0 where the device prefix
    cache is off."""
    if prefix_cache_bytes(cfg, c, dt) == 0 or cfg.schedule != "layer_major" or not arch_of(c).prefix_host:
        return 0
    if cfg.prefix_host_bytes != "auto":
        return round_down(int(cfg.prefix_host_bytes))
    n = PREFIX_HOST_AUTO_DEVICE_FACTOR * prefix_cache_bytes(cfg, c, dt)
    if free is not None:
        n = min(n, max(0, free) // PREFIX_HOST_AUTO_FREE_SHARE)
    return round_down(n)


def compute_dtype_bytes(cfg: EngineConfig) -> int:
    """Bytes per element of the worker's activations, KV and prefix cache (EngineConfig.torch_dtype)."""
    return 2 if cfg.is_cuda and cfg.dtype in ("auto", "bfloat16", "float16") else 4


# the worker's VRAM outside the hot slots, by part (SlotPlan.vram_parts; describe() names each "<part>_bytes")
VRAM_PARTS = ("dense", "kv", "prefix_cache", "ring", "activations", "cuda_context")


def vram_needs(f: GGUFModelFile, cfg: EngineConfig, slot_bytes: int, running: int) -> dict[str, int]:
    """Worker VRAM outside the hot slots, bytes by part (VRAM_PARTS), with `running` sequences: dense weights, KV
    caches of every running sequence, the prefix cache, the execution ring (with engine.pack_experts or tile_experts on
    a model they relay also the VRAM slots' relayout scratch and mma_pack's tile indices: relayout_bytes), activations
    (two experts dequantized in flight, the largest prefill pass, scratch), the CUDA context and the running
    sequences' decode graphs."""
    c = f.config
    arch = arch_of(c)
    dt = compute_dtype_bytes(cfg)
    kv = running * arch.state_bytes(c, cfg.max_context, dt)     # every running sequence's state, full
    deq = 2 * 3 * c.n_ff_exp * c.n_embd * dt                       # two experts' dequantized matrices in flight
    # activations of the largest prefill pass (a full-context prompt, or several prompts together) and the
    # attention scratch of its blocks (model/registry.py: each architecture's own shapes)
    act = arch.activation_bytes(c, cfg.prefill_pass_tokens, dt) + arch.scratch_bytes(c, cfg.max_context)
    if cfg.is_cuda:
        act += SPLITK_WORKSPACE_BYTES
    ctx = CUDA_CONTEXT_BYTES if cfg.is_cuda else 0
    if cfg.is_cuda and cfg.cuda_graphs:
        ctx += running * GRAPHS_BYTES_PER_SEQ
    return {"dense": dense_bytes(f, dt), "kv": kv, "prefix_cache": prefix_cache_bytes(cfg, c, dt),
            "ring": cfg.ring_slots * slot_bytes + relayout_bytes(f, cfg, slot_bytes), "activations": deq + act,
            "cuda_context": ctx}


def relayout_bytes(f: GGUFModelFile, cfg: EngineConfig, slot_bytes: int) -> int:
    """The VRAM engine.pack_experts and tile_experts add (ExpertCache.set_layouts): the relayout's slot-sized scratch
    (one for both) where some layer may take another layout, with pack_experts the layers with Q8_0 / MXFP4 / Q4_K
    experts (packing refuses at startup where it cannot), with tile_experts those tile_plan names (the model's types
    and shapes under act_quant; a layer the kernels then leave GGUF keeps its share counted: the triton backend's MV
    check and the torch kernels are the worker's to know), plus mma_pack's tile index of each packed (K, type); else
    0."""
    Ks = ({(p.shape[1], mma_pack.GGML[int(p.qtype)]) for l in range(f.config.n_layer) for p in f.expert_parts(l, 0)
           if int(p.qtype) in mma_pack.GGML and mma_pack.usable(*p.shape, mma_pack.GGML[int(p.qtype)])}
          if cfg.pack_experts else set())
    tiles = cfg.tile_experts and None in tile_plan([[f.expert_parts(l, 0)] for l in range(f.config.n_layer)],
                                                   cfg.act_quant)
    return (slot_bytes if Ks or tiles else 0) + sum(mma_pack.tile_index(*k).nbytes for k in Ks)


def plan_running(f: GGUFModelFile, cfg: EngineConfig, slot_bytes: int) -> tuple[int, dict[str, int], str]:
    """Sequences to reserve KV for -> (max_running, vram_needs with them, why).

    A number is kept as given. `auto`: the most of 1..MAX_RUNNING_AUTO whose fixed needs leave the VRAM budget
    `least` VRAM expert slots per layer, `least` being the configured vram_slots, or with vram_slots = auto the
    model's top-k (n_expert_used, at most n_expert). Why that floor: a decode step computes top-k experts per token
    and layer; below that the VRAM tier cannot hold even one token's experts, every step streams its experts
    through the ring, and the extra sequences' KV was bought with the slots that made each step fast. Where not
    even one sequence leaves the floor, auto takes 1 (the least that serves) and the VRAM tier gets what is left."""
    c = f.config
    if cfg.max_running != "auto":
        n = int(cfg.max_running)
        return n, vram_needs(f, cfg, slot_bytes, n), f"max_running={n} as configured"
    least = vram_floor(cfg.vram_slots, c.n_expert_used, c.n_expert)
    floor = "top-k" if cfg.vram_slots == "auto" else "vram_slots as configured"
    per_layer_slot = c.n_layer * slot_bytes           # one slot in every layer
    n = _fitting_running(f, cfg, slot_bytes, least, MAX_RUNNING_AUTO)
    if n:
        parts = vram_needs(f, cfg, slot_bytes, n)
        kv_each = parts["kv"] // n
        over = sum(vram_needs(f, cfg, slot_bytes, n + 1).values()) + least * per_layer_slot - cfg.vram_budget
        more = "" if n == MAX_RUNNING_AUTO else f"; {n + 1} would need {_mib(over)} more"
        return n, parts, (f"max_running=auto -> {n} (of at most {MAX_RUNNING_AUTO}): KV {_mib(kv_each)} a sequence "
                          f"({cfg.max_context} tokens) leaves the VRAM budget {_mib(cfg.vram_budget)} room for "
                          f"at least {least} VRAM expert slots per layer ({floor}){more}")
    parts = vram_needs(f, cfg, slot_bytes, 1)
    return 1, parts, (f"max_running=auto -> 1: even one sequence's KV ({_mib(parts['kv'])}) leaves the VRAM budget "
                      f"{_mib(cfg.vram_budget)} less than {least} VRAM expert slots per layer ({floor}, "
                      f"{_mib(least * per_layer_slot)})")


def _fitting_running(f: GGUFModelFile, cfg: EngineConfig, slot_bytes: int, vram_slots: int,
                     top: int | None = None) -> int:
    """The most sequences (0..top, default the configured max_running) whose fixed needs leave `vram_slots` per
    layer in the VRAM budget."""
    per_layer_slot = f.config.n_layer * slot_bytes
    top = int(cfg.max_running) if top is None else top
    return next((n for n in range(top, 0, -1)
                 if sum(vram_needs(f, cfg, slot_bytes, n).values()) + vram_slots * per_layer_slot <= cfg.vram_budget), 0)


def _auto_running(f: GGUFModelFile, cfg: EngineConfig, slot_bytes: int) -> int:
    """What max_running = auto would take with this configuration (for a refusal's message)."""
    return plan_running(f, dataclasses.replace(cfg, max_running="auto"), slot_bytes)[0]


def _engram_bytes(engram: dict | None) -> int:
    from betelgeuse.store.engram import EngramLayout
    return EngramLayout.from_dict(engram).nbytes if engram else 0


def engram_plan(f: GGUFModelFile, cfg: EngineConfig) -> dict | None:
    """The Engram region (banks + row cache; store/engram.py) of a model whose file has Engram tables, else None.
    Its bytes are part of the arena, so the memory budget below counts them."""
    g = f.config.ds41.engram if f.config.ds41 is not None else None
    if g is None:
        return None
    from betelgeuse.gguf.ds41layout import ENGRAM_TOKENS
    from betelgeuse.store.engram import EngramLayout, EngramTable
    tables = []
    for layer in g.layer_ids:
        t = f.tensors[f"blk.{layer}.engram_embd.weight"]
        tables.append(EngramTable(layer, t.offset, t.nbytes // t.shape[0], t.shape[0], t.qtype))
    rows = max(ENGRAM_TOKENS * g.n_cols, len(g.layer_ids) * g.n_cols)
    return EngramLayout.for_tables(tables, 0, rows, cfg.engram_cache_bytes).to_dict()


def plan_slots(f: GGUFModelFile, cfg: EngineConfig, memory_limit: int | None, memory_current: int = 0) -> SlotPlan:
    c = f.config
    part_max = tuple(max(f.expert_parts(layer, 0)[k].nbytes for layer in range(c.n_layer)) for k in range(3))
    slot = SlotLayout.for_parts(part_max)
    per_layer_slot = c.n_layer * slot.slot_bytes      # bytes for one slot in every layer
    notes: list[str] = []

    # the effective budget is the tighter of the configured one and the cgroup's: a --memory-max above the real
    # limit must never replace it (the arena would be OOM-killed while pre-faulting instead of refused here)
    limits = [x for x in (cfg.memory_max, memory_limit) if x is not None]
    limit = min(limits) if limits else None
    source = ("none" if limit is None else "cgroup memory.max" if limit == memory_limit and
              (cfg.memory_max is None or memory_limit < cfg.memory_max) else "memory_max")
    if cfg.memory_max is not None and memory_limit is not None and cfg.memory_max > memory_limit:
        notes.append(f"memory_max {_gib(cfg.memory_max)} is above the cgroup limit {_gib(memory_limit)}: using the cgroup's")

    engram = engram_plan(f, cfg)        # the Engram region of the arena (None: no Engram tables)
    engram_bytes = _engram_bytes(engram)

    # 0. the running sequences: their KV and decode graphs are part of the fixed needs below
    running, parts, why_running = plan_running(f, cfg, slot.slot_bytes)
    notes.append(why_running)

    # 1. VRAM: hot slots after everything else the worker places on the GPU
    fixed = sum(parts.values())
    if fixed > cfg.vram_budget:
        fits = _fitting_running(f, cfg, slot.slot_bytes, 0) if cfg.max_running != "auto" else 0
        raise BudgetError(f"the VRAM budget {_gib(cfg.vram_budget)} does not hold the worker's fixed needs "
                          f"{_gib(fixed)} (dense weights {_gib(parts['dense'])}, KV cache for {running} x "
                          f"{cfg.max_context} tokens {_gib(parts['kv'])}, prefix cache {_gib(parts['prefix_cache'])}, "
                          f"ring {_gib(parts['ring'])}, activations {_gib(parts['activations'])})"
                          + (f"; max_running={running} is over what fits: at most {fits} sequences' KV fit (set "
                             f"max_running = {fits}, or \"auto\": {_auto_running(f, cfg, slot.slot_bytes)} beside "
                             "the top-k's VRAM slots)" if fits else ""))
    if cfg.vram_slots == "auto":
        n_vram = min(c.n_expert, (cfg.vram_budget - fixed) // per_layer_slot)
        notes.append(f"vram_slots=auto -> {n_vram} per layer: VRAM budget {_mib(cfg.vram_budget)} - fixed "
                     f"{_mib(fixed)} (dense {_mib(parts['dense'])}, KV {_mib(parts['kv'])}, prefix cache "
                     f"{_mib(parts['prefix_cache'])}, ring {_mib(parts['ring'])}, activations {_mib(parts['activations'])}"
                     f", CUDA context {_mib(parts['cuda_context'])}) over {c.n_layer} layers x {_mib(slot.slot_bytes)}"
                     + (f" (every expert: {c.n_expert})" if n_vram == c.n_expert else ""))
        if not cfg.is_cuda and limit is not None and cfg.worker_reserve == "auto":
            # on the CPU the "VRAM" tier is the worker's RAM: each slot costs a slot there and (backed) one in the
            # arena, beside the worker's 1 GiB, its fixed needs and a minimal arena (4 staging slots)
            least_arena = ArenaLayout(c.n_layer, c.n_expert, 0, 4, slot, engram_bytes=engram_bytes).total_bytes
            room = limit - memory_current - HEADROOM - 1 * GiB - fixed - least_arena
            cpu_cap = max(0, room // (per_layer_slot * (2 if cfg.vram_backing is True else 1)))
            if cpu_cap < n_vram:
                notes.append(f"vram_slots=auto capped from {n_vram} to {cpu_cap}: on the CPU the VRAM tier is the "
                             f"worker's RAM, within the memory limit {_mib(limit)}")
                n_vram = cpu_cap
    else:
        n_vram = min(int(cfg.vram_slots), c.n_expert)
        need = fixed + n_vram * per_layer_slot
        if need > cfg.vram_budget:
            fits = _fitting_running(f, cfg, slot.slot_bytes, n_vram) if cfg.max_running != "auto" else 0
            raise BudgetError(f"{n_vram} VRAM slots per layer need {_gib(need)} of VRAM (fixed {_gib(fixed)}, KV cache "
                              f"for {running} x {cfg.max_context} tokens {_gib(parts['kv'])} of it, + "
                              f"{n_vram} x {c.n_layer} layers x {slot.slot_bytes} bytes), over the budget {_gib(cfg.vram_budget)}"
                              + (f"; beside them at most {fits} sequences' KV fit (max_running = {fits})"
                                 if fits and fits < running else ""))

    # 2. host: the worker's own needs, then the arena
    if cfg.worker_reserve == "auto":
        # on the CPU the "VRAM" tier and the dense weights live in the worker's RAM
        reserve = (1 * GiB + fixed + n_vram * per_layer_slot) if not cfg.is_cuda else 2 * GiB
    else:
        reserve = int(cfg.worker_reserve)
    free = None if limit is None else limit - memory_current - reserve - HEADROOM
    dt = compute_dtype_bytes(cfg)
    prefix_host = prefix_host_bytes(cfg, c, dt, free)
    if prefix_host:
        per_token = max(1, arch_of(c).state_bytes(c, cfg.max_context, dt) // cfg.max_context)
        notes.append(f"prefix host tier {_gib(prefix_host)}: ~{prefix_host // per_token:,} tokens of KV "
                     f"({_mib(per_token)} a token)" + (" (auto: 2 x the device cache, at most 1/16 of the free memory)"
                                                       if cfg.prefix_host_bytes == "auto" else ""))
    non_resident = c.n_expert - n_vram
    if cfg.staging_slots == "auto":
        cap_bytes = STAGING_AUTO_MAX_BYTES if free is None else min(STAGING_AUTO_MAX_BYTES,
                                                                    max(0, free) // STAGING_AUTO_FREE_SHARE)
        n_staging = max(4, min(2 * non_resident, 512, cap_bytes // slot.slot_bytes))
    else:
        n_staging = max(1, int(cfg.staging_slots))

    def arena_for(host_per_layer: int, n_stage: int) -> int:
        """Arena bytes with `host_per_layer` host slots per layer (VRAM backing copies included)."""
        return ArenaLayout(c.n_layer, c.n_expert, host_per_layer, n_stage, slot, engram_bytes=engram_bytes).total_bytes

    asked = cfg.vram_backing                              # True | False | "auto"
    backing = asked is True or (asked == "auto" and limit is None)
    why_backing = ("as configured" if asked != "auto" else
                   "auto: no memory limit, the copies cost no resident expert" if limit is None else "")
    if cfg.host_slots == "auto":
        if limit is None:
            n_host = c.n_expert - n_vram
            notes.append("host_slots=auto with no memory limit -> every expert resident")
        else:
            free -= prefix_host
            if cfg.staging_slots == "auto":
                while n_staging > 4 and arena_for(0, n_staging) > free:
                    n_staging //= 2
            # host slots per layer the memory allows, the VRAM tier's backing copies included
            cap = max(0, (free - arena_for(0, n_staging)) // per_layer_slot)
            if asked == "auto":
                # a copy costs a resident expert unless the memory holds every expert beside the copies
                backing = cap >= c.n_expert
                why_backing = (f"auto: the memory holds every expert beside them ({cap} slots per layer, {c.n_expert} "
                               "experts)" if backing else f"auto: host RAM binds ({cap} slots per layer for "
                               f"{c.n_expert} experts), so the {n_vram} slots per layer the copies would take hold "
                               "other experts; a restarted worker reads its VRAM tier from disk")
            n_backing = n_vram if backing else 0
            if cfg.vram_slots == "auto" and n_backing > cap:
                notes.append(f"vram_slots=auto capped from {n_vram} to {cap}: each VRAM expert needs a host backing slot")
                n_vram = n_backing = cap
            n_host = max(0, min(c.n_expert - n_vram, cap - n_backing))
            notes.append(f"host_slots=auto -> {n_host} per layer: memory limit {_mib(limit)} ({source}) - in use "
                         f"{_mib(memory_current)} - worker reserve {_mib(reserve)} - headroom {_mib(HEADROOM)} - "
                         f"prefix host tier {_mib(prefix_host)} - {n_staging} staging slots leaves room for {cap} slots "
                         f"per layer ({_mib(slot.slot_bytes)} each)"
                         + (f", {n_backing} of them the VRAM tier's backing copies" if n_backing else ""))
        # (staging stays as sized above even when every expert has a resident slot: a cold pass still reads
        # every expert through staging, and 4 slots serialised a cold 512-token pass behind 4 reads in flight)
    else:
        n_host = min(int(cfg.host_slots), non_resident)
        if asked == "auto" and limit is not None:
            # fixed host slots: the copies add no resident expert either way; kept when they fit the memory
            backing = arena_for(n_host + n_vram, n_staging) + prefix_host <= free
            why_backing = ("auto: they fit the memory limit" if backing else
                           f"auto: {n_vram} more host slots per layer would not fit the memory limit; a restarted "
                           "worker reads its VRAM tier from disk")

    if cfg.vram_slots != "auto":
        notes.append(f"vram_slots={n_vram} as configured" + (f" (the model has {c.n_expert})" if
                                                              int(cfg.vram_slots) > c.n_expert else ""))
    if cfg.host_slots != "auto":
        notes.append(f"host_slots={n_host} as configured" + (f" (at most the {non_resident} experts not in VRAM)" if
                                                              int(cfg.host_slots) > non_resident else ""))
    notes.append(f"vram_backing={'on' if backing else 'off'} ({why_backing}): {n_vram + n_host} distinct experts "
                 f"resident per layer of {c.n_expert} ({n_vram} VRAM + {n_host} host"
                 + (f"; the arena also holds the {n_vram} VRAM experts' copies)" if backing and n_vram else ")"))
    plan = SlotPlan(f.path, c.n_layer, c.n_expert, n_vram, n_host, n_staging, part_max, fixed, reserve, limit, notes,
                    backing, prefix_host, (str(cfg.vram_slots), str(cfg.host_slots)), cfg.vram_budget, parts,
                    source, memory_current, engram, str(asked).lower(), running, str(cfg.max_running))
    if limit is not None:
        need = plan.host_bytes + reserve + memory_current + HEADROOM
        if need > limit:
            raise BudgetError(
                f"slots do not fit the memory limit {_gib(limit)}: arena {_gib(plan.arena_bytes)} "
                f"({plan.host_per_layer} host slots x {c.n_layer} layers + {n_staging} staging, {slot.slot_bytes} bytes each"
                f"{f'; Engram banks and row cache {_gib(engram_bytes)}' if engram_bytes else ''}) "
                f"+ prefix host tier {_gib(prefix_host)} + worker {_gib(reserve)} + in use {_gib(memory_current)} + headroom {_gib(HEADROOM)} = {_gib(need)}")
    return plan
