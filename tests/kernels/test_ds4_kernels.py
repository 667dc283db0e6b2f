"""deepseek4's fused Triton kernels (kernels/triton_ds4.py TritonOps, the CUDA path) against TorchOps (the CPU
path, itself exact against transformers: tests/model/test_deepseek4_oracle.py), method by method under Triton's
interpreter (TRITON_INTERPRET=1), in float32 (IEEE dots: within summation-order noise) and bfloat16 (the CUDA
compute dtype: within a few bf16 ulps).

Also bit-for-bit: the ids each routing / indexer kernel picks, the state rows the decode steps copy (window ring,
compressor rows), and batch invariance: each row of a launch computed alone equals the same row in the full
launch (DESIGN.md invariant 6: a sequence's bits do not depend on what else runs). The engine-level checks on a
GPU (eager vs graph replay, batch invariance of a whole decode step) are deploy/device/check_ds4.py's.

And the whole model (ds4-tiny, and ds41-tiny: deepseek41 on the same kernels) with TritonOps against TorchOps,
prefill and static decode, within float32 noise.
The checks run in a child process: the interpreter is chosen when triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parents[1]          # tests/


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    path = tmp_path_factory.mktemp("ds4k") / "ds4-tiny.gguf"
    write_model(path, spec_from_preset("ds4-tiny"), progress=False)
    path41 = path.with_name("ds41-tiny.gguf")
    write_model(path41, spec_from_preset("ds41-tiny"), progress=False)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(HERE / "scripts" / "ds4_kernel_check.py"), str(path), str(path41)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results(checked) -> dict:
    return checked["ops"]


METHODS = ("hc_pre", "hc_pre_lagged", "hc_post", "rms_rope", "rope", "rms", "compress_step", "index_topk", "decode_attend",
           "route_topk", "route_hash", "route_approx", "shared_ffn", "linears", "grouped_linear")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_ops_match_torch_ops(results, dtype):
    sys.path.insert(0, str(HERE / "scripts"))
    from ds4_kernel_check import failures     # the tolerances (float32: summation-order noise, bf16: a few ulps)
    cases = {k: v for k, v in results.items() if k.split("/")[1] == dtype}
    assert {k.split("/")[0] for k in cases} == set(METHODS)
    assert failures(cases) == [], {k: cases[k] for k in failures(cases)}


def test_model_with_triton_ops_matches_torch_ops(checked):
    """The whole model (ds4-tiny, float32) with TritonOps: prefill and static one-token passes within float32 noise
    of TorchOps, the same greedy tokens (the ops as the model calls them: its shapes, strides and state)."""
    r = checked["model"]
    assert r["rows"] == 22 + 3
    assert r["max_abs"] <= 1e-5 * max(1.0, r["scale"]), r
    assert r["greedy_equal"], r


def test_deepseek41_with_triton_ops_matches_torch_ops(checked):
    """deepseek41 (ds41-tiny, float32) on deepseek4's kernels (decode_attend, routing) with its own steps in fixed
    shapes (every entry scored, the invisible -inf; chosen rows padded with the spare row): prefill and static
    one-token passes from position 3 within float32 noise of TorchOps, the same greedy tokens."""
    r = checked["model41"]
    assert r["rows"] == 3 + 7
    assert r["max_abs"] <= 1e-5 * max(1.0, r["scale"]), r
    assert r["greedy_equal"], r


def test_fused_guess_picks_the_per_layer_ids(checked):
    """The decode guess of layers l+1..l+D in one pass (TritonOps.guess_route over GuessStack: one mHC partial, one
    finish, one batched router matmul, one top-k for all D layers) picks exactly the ids each layer's own moe_input
    and route pick (worker.guess.guess_per_layer), from every layer at depths 1, 2, 3 (the last layers: fewer), on
    ds4-tiny (hash layers in range: their table rows) and ds41-tiny (the lagged collapse)."""
    for key, cases in (("guess", 3 * 2 + 2 + 1), ("guess41", 3 * 4 + 2 + 1)):
        r = checked[key]
        assert r["cases"] == cases and r["bad"] == [], (key, r)
    assert checked["guess"]["n_hash"] > 0


def test_decode_attend_reads_nothing_past_its_tensors():
    """_decode_attn_kernel's loads stay inside their tensors: each tensor ends at a PROT_NONE page, so an unmasked
    load past it faults under the interpreter (on CUDA it was an illegal address once the entries' next rows were
    unmapped: gpu-run47). Every mode, key counts that leave a block's last rows unused; the outputs = TorchOps."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(HERE / "scripts" / "ds4_attend_guard.py")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("ok 6"), (p.returncode, p.stderr[-2000:])


def test_triton_ops_have_the_torch_ops_surface():
    """TritonOps replaces TorchOps on CUDA (model.deepseek4.ops_for): every method, the same signature."""
    import inspect

    from betelgeuse.kernels.triton_ds4 import TritonOps
    from betelgeuse.model.deepseek4 import TorchOps
    public = [n for n in vars(TorchOps) if not n.startswith("_")]
    assert set(METHODS) | {"prepare"} <= set(public)
    for name in public:
        assert inspect.signature(getattr(TritonOps, name)) == inspect.signature(getattr(TorchOps, name)), name


def test_triton_ops_are_batch_invariant(results):
    inv = {k: v["row_invariant"] for k, v in results.items() if "row_invariant" in v}
    # every row-batched method is covered (the decode-step kernels run one sequence per launch)
    assert {k.split("/")[0] for k in inv} == {"hc_pre", "hc_pre_lagged", "hc_post", "rms_rope", "rope", "rms", "route_topk",
                                              "route_hash", "route_approx", "shared_ffn", "linears", "grouped_linear"}
    assert all(inv.values()), [k for k, v in inv.items() if not v]


LAUNCH_TARGET = 60      # kernels per layer of a decode step (issue 21); the device figure: check_ds4.py launches
LIBRARY_MATMULS = ("mm", "addmm", "bmm", "linear", "matmul")


def _counted_model(monkeypatch, tmp_path):
    """(ds4-tiny with TritonOps whose Triton launches only count, the launch counter)."""
    import torch

    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    from betelgeuse.kernels import triton_ds4
    from betelgeuse.kernels.triton_ds4 import TritonOps
    from betelgeuse.model.deepseek4 import Deepseek4Model
    from memtrack import stub_triton
    launches = stub_triton(monkeypatch)
    path = tmp_path / "ds4-tiny.gguf"
    write_model(path, spec_from_preset("ds4-tiny"), progress=False)
    with GGUFModelFile.open(str(path)) as f:
        c = f.config
        m = Deepseek4Model(c, Deepseek4Model.load_dense(f, "cpu", torch.float32))
    m.ops = TritonOps()
    m.ops.prepare(m.w, c.n_layer)
    # engine.decode_gemv on (the runner sets it per process): the dense projections' one launch a call
    monkeypatch.setattr(TritonOps, "gemv_rows", triton_ds4.GEMV_ROWS)
    return m, launches


def _rope_ops(k) -> int:
    """RoPE table launches a counted step made (the tables' cos and sin; Triton's compressor makes its own)."""
    return k.ops["cos"] + k.ops["sin"]


def test_decode_step_launches_per_layer(monkeypatch, tmp_path):
    """A static one-token pass of ds4-tiny with TritonOps (launches counted, not run) launches few kernels per
    layer: the dense part (attention, mHC, routing, shared expert) leaves room under the target for the runner's
    MoE step (its route / apply / combine). The RoPE tables are made once per step (cos and sin of both ropes), not
    per layer."""
    import torch

    from memtrack import KernelCount
    m, launches = _counted_model(monkeypatch, tmp_path)
    c = m.cfg
    cache = m.new_cache(64)
    ids = torch.tensor([5])
    routed = torch.zeros(1, c.n_embd)                    # the MoE step's output (the runner's kernels)
    with torch.no_grad():
        for step in range(2):                           # the second: every per-pass table already made once
            pos = cache.begin_static()
            with KernelCount(launches) as k:
                x = m.embed(ids)
                per = []
                for layer in range(c.n_layer):
                    before = k.total
                    x = m.attention_block(layer, x, cache, pos, static=True)
                    h, aux = m.moe_input(layer, x)
                    m.route(layer, h, ids, None)
                    x = m.moe_output(layer, x, aux, h, routed)
                    per.append(k.total - before)
            cache.commit()
            launches.clear()
    assert set(c.ds4.compress_ratios) == {0, 4, 128}     # every kind of layer counted
    assert max(per) <= LAUNCH_TARGET - 10, (per, k.ops.most_common(12))
    # the dense projections are TritonOps.linears / grouped_linear launches (7 a layer, every kind): no library
    # matmul, whose split-K at one row was two launches on CUDA (8 / 14 / 10 of them on ratio 0 / 4 / 128 layers)
    assert not any(k.ops[name] for name in LIBRARY_MATMULS), k.ops
    assert _rope_ops(k) == 4, k.ops


def test_decode_guess_launches(monkeypatch, tmp_path):
    """The guess a decode layer makes of the next 3 layers' experts (worker/guess.guess_ahead at depth 3) launches 4
    kernels whatever the depth and the hash layers in range (one mHC partial and one finish over the stacked rows of
    all guessed layers, one batched router matmul, one top-k or table row per layer and row); each layer's own
    moe_input and route (guess_per_layer, the earlier form) launched 4 per guessed layer plus a stack: 13 at depth
    3, which this bound fails."""
    import torch

    from betelgeuse.worker.guess import guess_ahead, guess_per_layer
    from memtrack import KernelCount
    m, launches = _counted_model(monkeypatch, tmp_path)
    L, n_hash = m.cfg.n_layer, m.p.n_hash_layers
    x, ids = torch.randn(1, m.p.hc_mult, m.cfg.n_embd), torch.tensor([5])

    def count(fn) -> int:
        launches.clear()
        with torch.no_grad(), KernelCount(launches) as k:
            fn()
        return k.total
    for layer in range(L - 1):
        n = min(3, L - 1 - layer)
        fused = count(lambda: guess_ahead(m, layer, x, ids, 3, L))
        assert fused <= 4, (layer, fused)
        per = count(lambda: guess_per_layer(m, layer, x, ids, n))
        assert per == 4 * n + 1, (layer, per)
    assert n_hash > 1 and count(lambda: guess_per_layer(m, 0, x, ids, 3)) == 13     # layer 0 guesses a hash layer


def test_lanes_decode_step_launches_per_layer(monkeypatch, tmp_path):
    """A batched decode step over the lanes (worker/lanes.py, eager: the kernels a captured step replays) of one and
    of three sequences launches, per layer, the dense part over all lanes plus each sequence's attention; the RoPE
    tables are made once per step for every lane (pre of layer 0) and read by every layer's attention (issue 21: they
    were recomputed per layer and sequence, ~5 launches each: lanes 64.8 per layer against solo 58.8 on the H200)."""
    import torch

    from betelgeuse.worker.lanes import Lanes
    from memtrack import KernelCount
    m, launches = _counted_model(monkeypatch, tmp_path)
    c = m.cfg
    lanes = Lanes(m, c.n_layer, 4, graphs=False)
    caches = [m.new_cache(64) for _ in range(3)]
    for n in (1, 3):
        kvs = caches[:n]
        routed = torch.zeros(n, c.n_embd)               # the MoE step's output rows (the runner's kernels)
        with torch.no_grad():
            for step in range(2):
                idx = lanes.join(kvs)
                pos = [kv.begin_static() for kv in kvs]
                with KernelCount(launches) as k:
                    lanes.begin(torch.tensor([5, 6, 7][:n]), kvs, idx)
                    per = []
                    for layer in range(c.n_layer):
                        before = k.total
                        lanes.front(layer, kvs, lambda l, h, ti, tw: None, lambda r, **kw: routed)
                        per.append(k.total - before)
                    lanes.head(kvs, lambda r, **kw: routed)
                    step = k.total
                for kv in kvs:
                    kv.commit()
                launches.clear()
        assert len(pos) == n
        # the dense part is the solo step's plus the lanes' own copies: a layer's attention rows into the lane
        # buffers and the running rows' h, expert ids and weights (and guesses) out of the lanes in one launch each
        # whatever their dtypes (TritonOps.copy_rows / gather_rows; were a cat per dtype and 3 index_selects), the
        # MoE rows combined straight into their lanes (no index_copy_), each sequence's attention written in place:
        # 39 per layer at n = 1 and 51 at n = 3 before, then 36 and 48; the rows written into the lane buffers by
        # the ops that make them (model.lane_rows out=: no copy) and the output projection's bmm into its rows'
        # layout (no clone), 34 and 46; each more sequence adds its attention
        assert max(per) <= LAUNCH_TARGET - 26 + 6 * (n - 1), (n, per, k.ops.most_common(12))
        # the library's matmuls: only the head's two (its mHC mix and the vocabulary projection, once a step)
        assert sum(k.ops[name] for name in LIBRARY_MATMULS) == 2, k.ops
        # the whole step: the per-step work too (begin's ids, positions and lanes in one launch, the RoPE tables
        # written into the lanes' table buffer: 3 kernels a rope, the embedding one gather, the head's rows
        # gathered without a clone): 160 at n = 1 and 194 at n = 3 before, here 143 and 177
        assert step <= 143 + 17 * (n - 1), (n, step, k.ops.most_common(12))
        assert _rope_ops(k) == 4, (n, k.ops)


def test_triton_lane_copies_equal_torch():
    """TritonOps.copy_rows / gather_rows (the lanes' copies, one launch for tensors of any dtypes, worker/lanes.py)
    move the same bits as TorchOps' copy_ / index_select, into strided column views too; the MoE combine with rows
    writes row t into out[rows[t]] the bits it returns alone (the lanes' residual, no index_copy_; TRITON_INTERPRET=1)."""
    code = """
import torch
from betelgeuse.kernels.triton_ds4 import TritonOps
from betelgeuse.model.deepseek4 import TorchOps
g = torch.Generator().manual_seed(0)
ts = [torch.randn(4, 3, 8, generator=g).bfloat16(), torch.randint(0, 9, (4, 6), generator=g),
      torch.randn(4, 5, generator=g)]
i = torch.tensor([3, 0])
ts.append(torch.randint(0, 9, (4, 3, 2), generator=g))     # decode guesses of 3 layers ahead [B, D, k] (worker/guess.py)
same = [torch.equal(a, b) for a, b in zip(TritonOps.gather_rows(i, ts), TorchOps.gather_rows(i, ts))]
flat, ref = torch.zeros(4, 40, dtype=torch.bfloat16), torch.ones(4, 40, dtype=torch.bfloat16)
outs = [[f[:, :24].view(4, 3, 8), f[:, 24:29]] for f in (flat, ref)]
src = [ts[0], ts[2][:, :5].bfloat16().contiguous()]
TritonOps.copy_rows(src, outs[0])
TorchOps.copy_rows(src, outs[1])
same.append(torch.equal(flat[:, :29], ref[:, :29]) and not flat[:, 29:].any())
from betelgeuse.kernels import triton_moe
y, w = torch.randn(6, 16, generator=g), torch.randn(2, 3, generator=g)
one = triton_moe.combine(y, w, torch.empty(2, 16))
into = triton_moe.combine(y, w, torch.zeros(4, 16), torch.tensor([3, 1]))
same.append(torch.equal(into[[3, 1]], one) and not into[[0, 2]].any())
# the lane buffers' writers (model.lane_rows out=): TritonOps.rms_rope / rope into a column range of a flat buffer
# (any token stride) write the bits they return alone; the RoPE tables into out= as the tables alone and as the
# angle computed once per pair and repeated
x, wn = torch.randn(4, 3, 16, generator=g), torch.rand(16, generator=g) + 0.5
pos = torch.tensor([0, 7, 300, 4096])
from betelgeuse.model.deepseek4 import InterleavedRope
rp = InterleavedRope.plain(8, 10000.0, "cpu")
cos, sin = rp.cos_sin(pos)
tab = torch.zeros(2, 4, 8)
freqs = pos[:, None].float() * rp.inv_freq[None, :]
same += [torch.equal(cos, freqs.cos().repeat_interleave(2, -1)), torch.equal(sin, freqs.sin().repeat_interleave(2, -1)),
         all(torch.equal(a, b) for a, b in zip(rp.cos_sin(pos, out=tab), (cos, sin))), torch.equal(tab[0], cos)]
flat = torch.zeros(4, 3 * 16 + 16 + 5)
q, kv = flat[:, :48].view(4, 3, 16), flat[:, 48:64]
same.append(torch.equal(TritonOps.rms_rope(x, None, cos, sin, 1e-6, out=q), TritonOps.rms_rope(x, None, cos, sin, 1e-6)))
same.append(torch.equal(TritonOps.rms_rope(x[:, 0], wn, cos, sin, 1e-6, out=kv),
                        TritonOps.rms_rope(x[:, 0], wn, cos, sin, 1e-6)))
same.append(torch.equal(flat[:, :48].view(4, 3, 16), TritonOps.rms_rope(x, None, cos, sin, 1e-6)))
same.append(torch.equal(TritonOps.rope(x, cos, sin, out=q), TritonOps.rope(x, cos, sin)) and not flat[:, 64:].any())
print(all(same), same)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=Path(__file__).parents[2])
    assert r.stdout.startswith("True"), (r.stdout, r.stderr[-2000:])


def test_prefill_resumed_at_a_chunk_boundary_is_bit_identical_with_the_gemv(monkeypatch, tmp_path):
    """engine.decode_gemv on (gemv_rows = GEMV_ROWS): a prefill chunk of up to GEMV_ROWS rows takes _gemv_kernel, a
    longer one the library's gemm, so one prompt's chunks may run both. The prefix (snapshot) cache still gives a
    hit the bits of a miss (invariant 6): chunks are position-aligned (model/chunks.py) and a snapshot resumes only
    at a chunk boundary (worker/snapshot_cache.py; the scheduler's pieces are whole chunks), so every chunk has the
    same rows, hence the same kernel, fresh or resumed. Here (ds4-tiny, float32, TritonOps under the interpreter)
    the chunk is GEMV_ROWS + 8 rows (the library's gemm) and the prompt's tail 9 (the Triton kernel): the checkpoint
    its pass keeps at the boundary (state.mark, the snapshot cache's), restored into a fresh state, prefills the
    tail and decodes a token to the same bits as the unbroken pass. (A resume off the grid, e.g. 40 tokens then 60
    more in one 256-row chunk against 100 at once, differs with the gemv off too (F.linear; ~1.5e-6): not a case
    the engine runs, test_deepseek4_resume.py; docs/benchmarks/cpu-gemv60/README.md.)"""
    import numpy as np
    import torch

    from betelgeuse.gguf.synth import spec_from_preset, write_model
    from betelgeuse.kernels import triton_ds4
    from betelgeuse.kernels.triton_ds4 import TritonOps
    from betelgeuse.model import reference_model
    path = tmp_path / "ds4-tiny.gguf"
    write_model(path, spec_from_preset("ds4-tiny"), progress=False)
    m = reference_model(path)
    m.ops = TritonOps()
    m.ops.prepare(m.w, m.cfg.n_layer)
    monkeypatch.setattr(TritonOps, "gemv_rows", triton_ds4.GEMV_ROWS)
    # logits a row at a time, as the runner's (one row a piece: runner._layer_major): the reference's over all the
    # pass's rows is one F.linear whose bits on a multi-threaded CPU depend on its rows (81 against 9: 9.5e-7 apart,
    # TorchOps too), the hidden rows under it equal
    whole_rows = m.logits
    monkeypatch.setattr(m, "logits", lambda x: torch.cat([whole_rows(x[i:i + 1]) for i in range(x.shape[0])]))
    # the rows of each _gemv_kernel call: the tail's, fresh and resumed alike (the full chunk's 72 the library's gemm)
    took, real = [], TritonOps._gemv
    monkeypatch.setattr(TritonOps, "_gemv", staticmethod(lambda xs, *a: (took.append(xs[0].shape[0]), real(xs, *a))[1]))
    m.chunk = chunk = triton_ds4.GEMV_ROWS + 8
    ids = torch.tensor(np.random.default_rng(4).integers(0, 512, chunk + 9))
    t = torch.tensor([7])
    kv = m.new_cache(len(ids) + 2)
    kv.mark(chunk)
    whole = m.forward(ids, kv)
    fresh, took[:] = set(took), []
    step = m.forward(t, kv)
    snap = kv.take_mark()
    assert snap is not None and snap.length == chunk
    kv2 = m.new_cache(len(ids) + 2)
    m.restore(kv2, snap)
    took.clear()
    rest = m.forward(ids[chunk:], kv2)
    assert torch.equal(rest, whole[chunk:]), f"max |diff| {(rest - whole[chunk:]).abs().max():.3e}"
    assert fresh == set(took) == {9}, (fresh, took)
    assert torch.equal(m.forward(t, kv2), step), "the decode step after the resumed prefill"
