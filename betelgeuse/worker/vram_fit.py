"""The VRAM budget held by measurement (issue 21 item 3): after attach's warm-ups the worker measures its VRAM, and
trims the VRAM tier until the projected peak fits, or refuses to serve naming the numbers.

The plan (store/plan.py vram_needs) counts what lies outside torch's tensors as a constant, CUDA_CONTEXT_BYTES. The
attach warm-ups grew that memory by ~340 MiB on an H100 (CUDA modules of each kernel variant, the driver's
local-memory reservation of spilling kernels, cuBLAS workspaces: worker/attach_steps.py), and the live service's
peak went 202 MiB over its budget (docs/benchmarks/gpu-run45-serve). So, once attach has launched every kernel
variant it will launch (the warm-ups; with warm-ups off the first tokens still grow it: the check then sees less):

    used, reserved    = measure(device)          device-wide used bytes (mem_get_info, after a sync), torch's reserve
    non_torch         = used - reserved          the CUDA context, modules, LMEM, ... as they are now
    plan_torch        = vram_fixed - CUDA_CONTEXT_BYTES + VRAM slots      every tensor the plan placed on the GPU:
                        dense, KV of max_running sequences, prefix cache, ring, activations, the decode graphs'
                        allowance (not captured at attach: worker/warm_decode.py captures none), the VRAM tier
    projected         = non_torch + max(plan_torch, reserved)

projected > vram_budget: the VRAM tier gives back ceil(over / (n_layer x slot_bytes)) slots per layer, not below the
floor (store/plan.py vram_floor: top-k, or vram_slots as configured); below it the worker refuses (BudgetError with
the numbers). The device-wide figure is what the bench holds to the budget (nvidia-smi's used, device-wide); another
process on the GPU counts against this worker too (it trims more, never less).

On the CPU there is no VRAM: measure() gives None and nothing is checked; the tests feed fake measurements through
ModelRunner.attach's `measure` (this module's, monkeypatched).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from betelgeuse.store.plan import CUDA_CONTEXT_BYTES, SlotPlan, mib_text, vram_floor
from betelgeuse.worker import attach_steps


def measure(device: torch.device) -> tuple[int, int] | None:
    """(device-wide used bytes, torch's reserved bytes) after a sync, on CUDA; None elsewhere."""
    got = attach_steps.vram_now(device)
    return None if got is None else (got[0], got[1])


@dataclass(slots=True)
class VramFit:
    """One check's numbers, bytes (module doc)."""
    used: int                   # device-wide used, measured
    torch_reserved: int         # torch's caching allocator's reserve, measured
    non_torch: int              # used - torch_reserved
    allowance: int              # what the plan allowed outside tensors (CUDA_CONTEXT_BYTES; 0 on a CPU plan)
    plan_torch: int             # the plan's tensors on the GPU, VRAM tier included
    projected: int              # non_torch + max(plan_torch, torch_reserved)
    budget: int                 # the plan's VRAM budget
    slots_before: int           # VRAM slots per layer in the plan
    slots_after: int            # the fewest that bring projected within the budget (slots_before: it fits)
    floor: int                  # the fewest the plan may keep
    slot_layer_bytes: int       # one VRAM slot in every layer

    @property
    def over(self) -> int:
        return self.projected - self.budget

    @property
    def refused(self) -> bool:
        return self.slots_after < self.floor

    def mib(self, *names: str) -> dict:
        """The named byte figures in MiB, one decimal, keyed "<name>_mib" (the runner's events); none named: every
        measured figure of the trim event."""
        names = names or ("non_torch", "allowance", "torch_reserved", "plan_torch", "projected", "budget", "over")
        return {f"{n}_mib": round(getattr(self, n) / (1 << 20), 1) for n in names}

    def record(self) -> dict:
        """The numbers as a dict (SlotPlan.vram_trim, the runner's warmed["vram_fit"], bench.json)."""
        return asdict(self)


def check(plan: SlotPlan, n_expert_used: int, used: int, torch_reserved: int) -> VramFit:
    """A measurement against the plan -> its VramFit (module doc)."""
    allowance = min(CUDA_CONTEXT_BYTES, plan.vram_parts.get("cuda_context", 0))
    non_torch = used - torch_reserved
    plan_torch = plan.vram_fixed - allowance + plan.vram_slot_bytes
    projected = non_torch + max(plan_torch, torch_reserved)
    per = plan.n_layer * plan.slot.slot_bytes
    over = projected - plan.vram_budget
    after = plan.n_vram - (-(-over // per) if over > 0 else 0)
    return VramFit(used, torch_reserved, non_torch, allowance, plan_torch, projected, plan.vram_budget, plan.n_vram,
                   after, vram_floor(plan.requested[0], n_expert_used, plan.n_expert), per)


def refusal(f: VramFit) -> str:
    """Why the worker does not serve: the numbers, and what to change."""
    m = mib_text
    return (f"the worker's VRAM does not fit its budget: measured after attach {m(f.used)} on the device "
            f"({m(f.non_torch)} outside torch's allocator, where the plan allowed {m(f.allowance)} for the CUDA "
            f"context), projected peak {m(f.projected)} with the plan's tensors ({m(f.plan_torch)}), {m(f.over)} over "
            f"the VRAM budget {m(f.budget)}; fitting needs {f.slots_after} VRAM slots per layer, under the floor of "
            f"{f.floor} (of {f.slots_before} planned; {m(f.slot_layer_bytes)} a slot in every layer): raise the VRAM "
            "budget, or lower max_running, the prefix cache or vram_slots")
