"""The device scripts' shared setup: this checkout first on sys.path, the model / device / slots arguments, and a
synth model written where the path does not exist yet.

A script run as `python3 deploy/device/NAME.py` has this folder as sys.path[0], so `import _common` (before any
betelgeuse import) finds it; importing it puts the checkout's root before an installed betelgeuse, so the script runs
the library of the checkout it stands in. (decode_host.py and store_messages.py leave sys.path to PYTHONPATH on
purpose, for A/Bs against another checkout, and so do not import this.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

FEW_SLOTS = "VRAM+host slots per layer (few, so that decode misses)"


def default_device() -> str:
    """cuda where torch sees a GPU, else cpu (imports torch only when asked)."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_model_args(ap: argparse.ArgumentParser, *, slots: str, slots_help: str, device: str | None = None,
                   model_optional: bool = False) -> None:
    """The positional MODEL (a GGUF path; `model_optional`: may be left out), `--device` (default `device`, or cuda
    where there is one) and `--slots V+H` (VRAM + host slots per layer: slot_pair reads it)."""
    ap.add_argument("model", **({"nargs": "?"} if model_optional else {}))
    ap.add_argument("--device", default=device or default_device())
    ap.add_argument("--slots", default=slots, help=slots_help)


def slot_pair(text: str, sep: str = "+") -> tuple[int, int]:
    """'V+H' -> (vram_slots, host_slots)."""
    vram, host = (int(x) for x in text.split(sep))
    return vram, host


def synth_if_missing(path: str | Path, spec, say: str | None = None) -> Path:
    """Writes the synth model `spec` (betelgeuse.gguf.synth) to `path` unless a file is there -> path. `say`: a
    format of the line printed after writing ({path}, {secs}), none when None."""
    path = Path(path)
    if not path.exists():
        from betelgeuse.gguf.synth import write_model
        t = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)     # a bare machine has no /var/tmp/<dir> yet
        write_model(path, spec, progress=False)
        if say is not None:
            print(say.format(path=path, secs=time.perf_counter() - t), flush=True)
    return path
