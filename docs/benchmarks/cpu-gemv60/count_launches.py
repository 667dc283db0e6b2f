"""Decode launches per layer by layer kind (ratio 0 / 4 / 128), solo and lanes (n = 1 of 4 lanes): ds4-tiny with
TritonOps whose Triton launches only count (tests/memtrack.py stub_triton, as tests/kernels/test_ds4_kernels.py), torch
ops counted by KernelCount: the CPU's count of a CUDA step's launches, where a library matmul counts 1 ("matmuls": on
CUDA a split-K GEMM at decode's rows is 2, "cuda_est" counts them so). The second step's figures, each kind's last
layer. Run from a checkout's root:

    PYTHONPATH=$PWD .venv/bin/python docs/benchmarks/cpu-gemv60/count_launches.py
"""
import collections, json, sys
sys.path.insert(0, "tests")
import torch
import pytest
from memtrack import KernelCount, stub_triton

class MP:
    def __init__(self): self.undo = []
    def setattr(self, obj, name, val):
        self.undo.append((obj, name, getattr(obj, name))); setattr(obj, name, val)

from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.kernels.triton_ds4 import TritonOps
from betelgeuse.model.deepseek4 import Deepseek4Model
from betelgeuse.worker.lanes import Lanes
launches = stub_triton(MP())
path = "/tmp/gemv60-ds4-tiny.gguf"
write_model(path, spec_from_preset("ds4-tiny"), progress=False)
with GGUFModelFile.open(path) as f:
    c = f.config
    m = Deepseek4Model(c, Deepseek4Model.load_dense(f, "cpu", torch.float32))
m.ops = TritonOps(); m.ops.prepare(m.w, c.n_layer)
if hasattr(TritonOps, "gemv_rows"):         # engine.decode_gemv on (the setting came at the merge; main before: none)
    from betelgeuse.kernels.triton_ds4 import GEMV_ROWS
    TritonOps.gemv_rows = GEMV_ROWS
ratios = c.ds4.compress_ratios
MM = {"mm", "addmm", "linear", "bmm", "matmul"}
def report(name, per, ops_per):
    out = {}
    for r in sorted(set(ratios)):
        ls = [i for i, x in enumerate(ratios) if x == r]
        l = ls[-1]
        mm = sum(v for k, v in ops_per[l].items() if k in MM)
        out[f"ratio{r}"] = {"launches": per[l], "matmuls": mm, "cuda_est": per[l] + mm,
                            "top": ops_per[l].most_common(40)}
    print(name, json.dumps(out))
# solo
cache = m.new_cache(64); ids = torch.tensor([5]); routed = torch.zeros(1, c.n_embd)
with torch.no_grad():
    for step in range(2):
        pos = cache.begin_static()
        per, ops_per = [], []
        x = m.embed(ids)
        for layer in range(c.n_layer):
            launches.clear()
            with KernelCount(launches) as k:
                x = m.attention_block(layer, x, cache, pos, static=True)
                h, aux = m.moe_input(layer, x)
                m.route(layer, h, ids, None)
                x = m.moe_output(layer, x, aux, h, routed)
            per.append(k.total); ops_per.append(collections.Counter(k.ops) + collections.Counter(launches))
        cache.commit()
report("solo", per, ops_per)
# lanes n=1 of B=4
lanes = Lanes(m, c.n_layer, 4, graphs=False)
kvs = [m.new_cache(64)]
routed = torch.zeros(1, c.n_embd)
with torch.no_grad():
    for step in range(2):
        idx = lanes.join(kvs); pos = [kv.begin_static() for kv in kvs]
        lanes.begin(torch.tensor([5]), kvs, idx)
        per, ops_per = [], []
        for layer in range(c.n_layer):
            launches.clear()
            with KernelCount(launches) as k:
                lanes.front(layer, kvs, lambda l, h, ti, tw: None, lambda r, **kw: routed)
            per.append(k.total); ops_per.append(collections.Counter(k.ops) + collections.Counter(launches))
        lanes.head(kvs, lambda r, **kw: routed)
        for kv in kvs: kv.commit()
report("lanes", per, ops_per)
print("ratios", ratios)
