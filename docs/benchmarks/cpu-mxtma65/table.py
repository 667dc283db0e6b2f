"""docs/benchmarks/cpu-mxtma65: sass_st.py's JSON lines (after-3.6 / after-3.9.jsonl) -> the README's table: per kernel
and ST, registers and shared memory bytes with the CTAs a SM each allows, the K loop's SASS a step and loads, and the
weight bytes in flight a SM (CTAs x steps ahead x the ring step's bytes; CTAs: the fewest of the registers', the
shared memory's and the grid's programs a SM).
    .venv/bin/python docs/benchmarks/cpu-mxtma65/table.py
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
# programs of the bench launch (H 2048, F 768, BN 64, 16 experts x rows, KCB 16) over 132 SMs: gate_up 12 tiles x 16
# row blocks (x 4 K chunks at 1 row: split-K), down 32 x 16 (x 2)
PROGRAMS = {("gate_up", 1): 768, ("gate_up", 16): 192, ("down", 1): 1024, ("down", 16): 512}


def rows(v: str):
    for line in (HERE / f"after-{v}.jsonl").read_text().splitlines():
        r = json.loads(line)
        (lp,) = r["loops"]
        step = (128 if r["kernel"] == "gate_up" else 64) // 2 * 64    # the ring step: [R / 2, 16] int32
        ctas = min(r["ctas_regs"], r["ctas_smem"], PROGRAMS[r["kernel"], r["bucket"]] / 132)   # resident a SM
        ahead = r["st"] - 1 if r["st"] else 1                          # GP 1 PK: one step in registers
        lds = {k: v for k, v in lp["ops"].items() if k.startswith(("LDG.", "LDGSTS", "LDS.128"))}
        yield (f"| {v} | {r['type']} | {r['kernel']} | {r['bucket']} | {r['st'] or '0 (GP1 PK)'} | {r['regs']} "
               f"({r['ctas_regs']}) | {r['smem']} ({r['ctas_smem']}) | {lp['n']} | {r['whole'].get('LDGSTS', 0)} | "
               f"{', '.join(f'{k} {n}' for k, n in sorted(lds.items()))} | {lp['ldg_in_step']} | "
               f"{ctas:.3g} x {ahead} x {step} = {ctas * ahead * step / 1024:.0f} KiB | "
               f"{PROGRAMS[r['kernel'], r['bucket']] / 132:.1f} |")


print("| Triton | type | kernel | rows | ST | registers (CTAs) | shared bytes (CTAs) | SASS a step | LDGSTS in the "
      "kernel | the loop's loads | loads read in their step | weight bytes in flight a SM | programs a SM |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for v in ("3.6", "3.9"):
    for line in rows(v):
        print(line)
