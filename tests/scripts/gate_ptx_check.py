"""decode_gate's kernels (kernels/triton_gate.py) compiled ahead of time for sm_90 (H200): no GPU needed.

Prints one JSON line {"skipped": reason} when this Triton cannot compile for CUDA here, else, per kernel, what the
device would run: the marker's and rows' stores (written through: st.global.wt), the system fence (membar.sys)
after them, and the spin's loads (ld.volatile inside the loop, not hoisted out of it). Run WITHOUT TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
assert os.environ.get("TRITON_INTERPRET") != "1", "compiles for CUDA: run me without TRITON_INTERPRET"


def main():
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from betelgeuse.kernels import triton_gate as tg
    except Exception as e:  # noqa: BLE001 - no CUDA backend here: nothing to check
        return {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
    target = GPUTarget("cuda", 90, 32)
    gate = {"flag_ptr": "*i32", "err_ptr": "*i32", "spin_ptr": "*i32", "arm_ptr": "*i32", "anchor_ptr": "*i64",
            "mark_off": "i64", "open_off": "i64", "tab_off": "i64", "miss_ptr": "*i64", "tag_ptr": "*i64",
            "max_iter": "i32", "E": "i32", "EP": "constexpr", "FENCE": "constexpr"}
    pub = {"counts_ptr": "*i64", "at_ptr": "*i64", "guess_ptr": "*i64", "flag_ptr": "*i32", "anchor_ptr": "*i64",
           "out_off": "i64", "E": "i32", "G": "i32", "EP": "constexpr", "GP": "constexpr", "FENCE": "constexpr"}
    out = {}
    try:
        for name, fn, sig, cst in (("gate", tg._gate_kernel, gate, {"EP": 128, "FENCE": True}),
                                   ("publish", tg._publish_kernel, pub, {"EP": 128, "GP": 32, "FENCE": True})):
            ptx = triton.compile(ASTSource(fn, sig, cst), target=target).asm["ptx"]
            lines = [x.strip() for x in ptx.splitlines()]
            body = [x for x in lines if re.search(r"\bst\.global|\bld\.volatile|\bmembar|\bfence\.|^\$L__BB|\bbra\b", x)]
            out[name] = body
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
