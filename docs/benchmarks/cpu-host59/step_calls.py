#!/usr/bin/env python3
"""Calls inside a decode layer's expert step, counted (issue 21, docs/benchmarks/cpu-host58; cpu-host59 adds the torch /
numpy call sites and every Python function): deploy/device/
decode_host.py run as is, with sys.setprofile counting, in the main thread, every call made while a decode layer's
host part of the expert step runs (MoEStep.hand_experts: the lanes; MoEStep.hand_misses: the solo graphs), less the
kernels' own (MoEKernels.apply: torch math on the CPU, two Triton launches on CUDA, counted as `apply` calls) ->
its JSON plus "step_calls": per decode layer (all of them, misses or not, timed steps or not): Python functions (each
comprehension and generator one too, as Python 3.11 runs them), torch C calls (a tensor method, torch.*, an event's),
numpy C calls, other C calls (builtins, dict / list methods), the apply calls, the 40 most frequent by name and
every torch and numpy one.
Counting slows the run: read its timings with care, the counts are exact. ab.py runs it on either checkout.

    python3 docs/benchmarks/cpu-host59/step_calls.py --preset ds4-wide --vram 49 --host 77 --form lanes \\
        --flex on --flex-slots 40 --tokens 40
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

from betelgeuse.kernels import moe as kmoe
from betelgeuse.worker import moe_step

ROOTS = {moe_step.MoEStep.hand_experts.__code__, moe_step.MoEStep.hand_misses.__code__}
APPLY = kmoe.MoEKernels.apply.__code__
CALLS: collections.Counter = collections.Counter()     # (kind, name) -> calls
SITES: collections.Counter = collections.Counter()    # torch / numpy calls by call site
STATE = {"depth": 0, "skip": 0, "layers": 0, "apply": 0}


def _kind(fn) -> str:
    """A C call's kind: torch, numpy or other."""
    owner = getattr(fn, "__self__", None)
    mod = getattr(fn, "__module__", None) or type(owner).__module__ or ""
    if isinstance(owner, (torch.Tensor, torch.cuda.Event if torch.cuda.is_available() else torch.Tensor)) or \
            mod.startswith("torch") or "_VariableFunctions" in getattr(fn, "__qualname__", ""):
        return "torch"
    if isinstance(owner, np.ndarray) or mod.startswith("numpy"):
        return "numpy"
    return "c"


def _profile(frame, event, arg):
    if event == "call":
        co = frame.f_code
        if co in ROOTS:
            if not STATE["depth"]:
                STATE["layers"] += 1
            STATE["depth"] += 1
        elif STATE["depth"] and not STATE["skip"]:
            if co is APPLY:
                STATE["skip"] += 1
                STATE["apply"] += 1
            else:
                CALLS["py", f"{Path(co.co_filename).name}:{co.co_name}"] += 1
        elif co is APPLY and STATE["skip"]:
            STATE["skip"] += 1
    elif event == "return":
        co = frame.f_code
        if co in ROOTS:
            STATE["depth"] -= 1
        elif co is APPLY and STATE["skip"]:
            STATE["skip"] -= 1
    elif event == "c_call" and STATE["depth"] and not STATE["skip"]:
        kind = _kind(arg)
        CALLS[kind, getattr(arg, "__qualname__", str(arg))] += 1
        if kind in ("torch", "numpy"):      # where each is made (file:function:line): what to cut
            SITES[f"{kind}:{getattr(arg, '__qualname__', str(arg))}@{Path(frame.f_code.co_filename).name}:"
                  f"{frame.f_code.co_name}:{frame.f_lineno}"] += 1


def main() -> int:
    script = Path(__file__).resolve().parents[3] / "deploy" / "device" / "decode_host.py"
    sys.argv = [str(script)] + sys.argv[1:]
    out = io.StringIO()
    sys.setprofile(_profile)
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    res = json.loads(out.getvalue())
    n = max(1, STATE["layers"])
    by_kind = collections.Counter()
    for (kind, _), v in CALLS.items():
        by_kind[kind] += v
    res["step_calls"] = {"layers": STATE["layers"], **{f"{k}_per_layer": round(by_kind[k] / n, 2)
                                                       for k in ("py", "torch", "numpy", "c")},
                         "apply_per_layer": round(STATE["apply"] / n, 2),
                         "top": {f"{k}:{name}": round(v / n, 2) for (k, name), v in CALLS.most_common(40)},
                         # every torch and numpy call by name (a few a layer: each costs a CUDA host more)
                         "torch_numpy": {f"{k}:{name}": round(v / n, 2) for (k, name), v in CALLS.most_common()
                                         if k in ("torch", "numpy")},
                         "sites": {k: round(v / n, 2) for k, v in SITES.most_common()},
                         "py_top": {name: round(v / n, 2) for (k, name), v in CALLS.most_common() if k == "py"}}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
