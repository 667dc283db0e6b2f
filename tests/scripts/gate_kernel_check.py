"""Run under TRITON_INTERPRET=1 (tests/worker/test_decode_at_hand.py): decode_gate's kernels (kernels/triton_gate.py).

Prints one JSON line: publish's host row (rows per expert, guesses, misses) and flag against numpy's, written through
an offset from an anchor tensor into another buffer (as into device-mapped pinned memory on CUDA); a gate whose flag
is set (nothing missed) writes its marker, passes and gives the misses' group an empty table (all -1) whatever the
host's table holds; an armed one whose layer missed something and whose open word never gets the step's tag gives up
after max_iter loads and sets the error flag; a disarmed one writes its marker and passes at once; an armed one passes
once another thread (the host's drain) writes the miss table and then the open word, and copies that table.
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
# the gate's words in another host buffer: marker [1], open word [1], miss table [E]
words = torch.full((2 + E,), -1, dtype=torch.int64)
w0 = words.data_ptr() - anchor.data_ptr()
assert w0 % 8 == 0
mark, open_, tab = w0 // 8, w0 // 8 + 1, w0 // 8 + 2
wn = words.numpy()
miss = torch.full((E,), -5, dtype=torch.int64)
table = rng.integers(0, 1 << 30, E).astype(np.int64) * 16
table[rng.random(E) < 0.5] = -1


def gate(max_iter):
    err.zero_()
    spins.zero_()
    miss.fill_(-5)
    triton_gate.gate(flags[1:2], err, spins, arm, anchor, mark, open_, tab, miss, tag, max_iter)
    return {"mark": int(wn[0]), "err": int(err), "spun": int(spins)}


wn[2:] = table
flags[1] = 1                                     # nothing missed: passes, the misses' group gets an empty table
out["open_gate"] = gate(100)
out["open_gate_table_empty"] = bool((miss.numpy() == -1).all())
flags[1] = 0                                     # missed, armed, the host never opens: gives up
tag[0] = 42
out["closed_gate"] = gate(50)
# disarmed (an eager or captured part: the host drains first and copies the table itself): the marker, no spin
arm[0], tag[0] = 0, 43
out["disarmed_gate"] = gate(50)
# armed, missed: another thread (the host's drain) writes the table, then the open word, while the gate spins; the
# gate sees them (volatile loads of real memory), passes without an error, counts the loads spun, copies the table
arm[0], tag[0] = 1, 44
wn[2:] = -1
late = rng.integers(0, 1 << 30, E).astype(np.int64) * 16


def host():
    time.sleep(0.3)
    wn[2:] = late
    wn[1] = 44


t = threading.Thread(target=host)
t0 = time.perf_counter()        # before the host thread starts its 0.3 s sleep: the gate cannot pass sooner after t0
t.start()
out["late_open_gate"] = gate(1 << 30)
out["late_open_s"] = time.perf_counter() - t0
out["late_open_table_copied"] = bool((miss.numpy() == late).all())
t.join()
print(json.dumps(out))
