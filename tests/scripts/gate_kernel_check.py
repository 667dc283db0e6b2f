"""Run under TRITON_INTERPRET=1 (tests/worker/test_decode_at_hand.py): decode_gate's kernels (kernels/triton_gate.py).

Prints one JSON line: publish's host row (rows per expert, guesses, misses) and flag against numpy's, written through
an offset from an anchor tensor into another buffer (as into device-mapped pinned memory on CUDA); a gate whose flag
is set writes its marker and passes; one whose flag stays 0 gives up after max_iter loads and sets the error flag; a
disarmed one writes its marker and passes whatever its flag; an armed one passes once another thread sets its flag.
"""

import json
import os
import sys
import threading
import time

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from betelgeuse.kernels import triton_gate  # noqa: E402

rng = np.random.default_rng(0)
E, G = 24, 12
counts = torch.from_numpy(rng.integers(0, 3, E).astype(np.int64))
at = torch.from_numpy(np.where(rng.random(E) < 0.3, -1, rng.integers(0, 1 << 30, E) * 16 - (1 << 33)).astype(np.int64))
guess = torch.from_numpy(rng.integers(0, E, G).astype(np.int64))
host = torch.full((E + G + 1 + 1,), -7, dtype=torch.int64)
anchor = torch.zeros(1, dtype=torch.int64)
d = host.data_ptr() - anchor.data_ptr()
assert d % 8 == 0
off = d // 8
flags, err, tag = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.tensor([41])
triton_gate.publish(counts, at, guess, flags[0:1], anchor, off, G)
misses = int(((counts > 0) & (at == -1)).sum())
row = host.numpy()
out = {"counts_ok": bool((row[:E] == counts.numpy()).all()), "guess_ok": bool((row[E:E + G] == guess.numpy()).all()),
       "misses": int(row[E + G]), "misses_want": misses, "flag": int(flags[0]), "flag_want": int(misses == 0)}
triton_gate.publish(counts, torch.where(at == -1, 0, at), guess, flags[0:1], anchor, off, 0)   # nothing missed
out["flag_all_at_hand"], out["misses_all_at_hand"] = int(flags[0]), int(row[E])
arm, spins = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
mark = off + E + G + 1


def gate(max_iter):
    err.zero_()
    spins.zero_()
    triton_gate.gate(flags[1:2], err, spins, arm, anchor, mark, tag, max_iter)
    return {"mark": int(row[E + G + 1]), "err": int(err), "spun": int(spins)}


flags[1] = 1
out["open_gate"] = gate(100)
flags[1] = 0
tag[0] = 42
out["closed_gate"] = gate(50)
# disarmed (an eager or captured part: the host drains first): the marker, no spin, no error, flag or not
arm[0], tag[0] = 0, 43
out["disarmed_gate"] = gate(50)
# armed, the flag set by another thread while the gate spins (as the host's side stream does): the gate sees the
# store (volatile loads of real memory), passes without an error, and counts the loads it spun
arm[0], tag[0] = 1, 44
t = threading.Thread(target=lambda: (time.sleep(0.3), flags[1:2].fill_(1)))
t.start()
t0 = time.perf_counter()
out["late_flag_gate"] = gate(1 << 30)
out["late_flag_s"] = time.perf_counter() - t0
t.join()
print(json.dumps(out))
