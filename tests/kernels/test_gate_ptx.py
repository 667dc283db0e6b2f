"""decode_gate's kernels as the device runs them (kernels/triton_gate.py, compiled for sm_90 without a GPU).

The gate writes its layer's marker into device-mapped host memory and then spins in the same kernel until the host
writes the step's tag into the layer's open word: the marker must reach system memory while the kernel runs (written
through, then a system fence), every iteration of the spin must load the open word again (volatile, inside the loop),
and the miss table the host wrote before it must be read after the loop, fenced (an acquire at system scope) and
volatile (not a cached line of an earlier step). publish's row (counts, guesses, misses) must be in system memory
before its kernel ends (the gate's marker follows it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parents[1]


def test_gate_marker_is_fenced_to_the_host_and_the_spin_reloads_its_flag():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, str(HERE / "scripts" / "gate_ptx_check.py")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    if "skipped" in res:
        pytest.skip(f"Triton cannot compile for sm_90 here: {res['skipped']}")
    g = res["gate"]
    marker = next(i for i, x in enumerate(g) if "st.global.wt.b64" in x)         # the tag, written through
    fence = next(i for i, x in enumerate(g) if x.startswith("membar.sys") or x.startswith("fence.sc.sys"))
    loop = next(i for i, x in enumerate(g) if x.startswith("$L__BB") and i > fence)
    assert marker < fence < loop, g
    back = next(i for i, x in enumerate(g) if i > loop and "bra" in x)           # the loop's branch back
    assert any("ld.volatile.global" in x for x in g[loop:back]), g              # the open word reloaded every iteration
    after = next(i for i, x in enumerate(g) if i > back and (x.startswith("membar.sys") or x.startswith("fence.sc.sys")))
    table = [i for i, x in enumerate(g) if i > back and "ld.volatile.global" in x]
    assert table and min(table) > after, g                                      # the miss table: fenced, volatile
    pub = res["publish"]
    rows = [i for i, x in enumerate(pub) if "st.global.wt" in x]
    fence = next(i for i, x in enumerate(pub) if x.startswith("membar.sys") or x.startswith("fence.sc.sys"))
    assert len(rows) >= 3 and max(rows) < fence, pub                            # counts, guesses, misses, fenced
