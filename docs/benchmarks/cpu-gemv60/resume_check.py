"""inv60: a deepseek4 prefill resumed from the checkpoint its pass kept at a chunk boundary (state.mark, restored
into a fresh state: the snapshot cache's hit) against the unbroken pass, with TritonOps under the interpreter and
gemv_rows 64 (engine.decode_gemv on) or 0: the tail's logits (a row at a time, as the runner's) and the next decode
step, bit for bit. README "Prefix and chunk invariance". Run from the repository root:
    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 .venv/bin/python docs/benchmarks/cpu-gemv60/resume_check.py"""
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
import numpy as np
import torch

from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.kernels.triton_ds4 import TritonOps
from betelgeuse.model import reference_model

path = "/tmp/inv60/ds4-tiny.gguf"
if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_model(path, spec_from_preset("ds4-tiny"), progress=False)
m = reference_model(path)
m.ops = TritonOps(); m.ops.prepare(m.w, m.cfg.n_layer)
orig = m.logits
m.logits = lambda x: torch.cat([orig(x[i:i+1]) for i in range(x.shape[0])])
P = torch.tensor(np.random.default_rng(4).integers(0, 512, 400))
def case(chunk, n, cut, rows):
    TritonOps.gemv_rows = rows; m.chunk = chunk; t0 = time.time()
    kv = m.new_cache(n + 2); kv.mark(cut)
    whole = m.forward(P[:n], kv); step = m.forward(torch.tensor([7]), kv)
    snap = kv.take_mark(); kv2 = m.new_cache(n + 2); m.restore(kv2, snap)
    rest = m.forward(P[cut:n], kv2); step2 = m.forward(torch.tensor([7]), kv2)
    print(f"chunk {chunk} n {n} cut {cut} gemv_rows {rows}: tail logits equal {torch.equal(rest, whole[cut:])} "
          f"max {(rest - whole[cut:]).abs().max():.3e}, decode step equal {torch.equal(step, step2)} ({time.time()-t0:.0f}s)", flush=True)
case(96, 232, 192, 64)
case(256, 300, 256, 64)
case(256, 300, 256, 0)
