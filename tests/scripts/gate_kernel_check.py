"""Run under TRITON_INTERPRET=1 (tests/worker/test_decode_at_hand.py): decode_gate's kernels (kernels/triton_gate.py).

Prints one JSON line: publish's host row (rows per expert, guesses, misses) and flag against numpy's, written through
an offset from an anchor tensor into another buffer (as into device-mapped pinned memory on CUDA); a gate whose flag
is set writes its marker and passes; one whose flag stays 0 gives up after max_iter loads and sets the error flag.
"""

import json
import os
import sys

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
flags[1] = 1
triton_gate.gate(flags[1:2], err, anchor, off + E + G + 1, tag, 100)
out["open_gate"] = {"mark": int(row[E + G + 1]), "err": int(err)}
flags[1] = 0
tag[0] = 42
triton_gate.gate(flags[1:2], err, anchor, off + E + G + 1, tag, 50)
out["closed_gate"] = {"mark": int(row[E + G + 1]), "err": int(err)}
print(json.dumps(out))
