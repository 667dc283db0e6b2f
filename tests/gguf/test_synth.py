"""The model generator, checked with gguf's own reader/dequantizer and Hugging Face transformers."""

import hashlib
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT, GGUFReader
from gguf.quants import dequantize

from betelgeuse.errors import InvalidRequestError
from betelgeuse.gguf.synth import PRESETS, SynthSpec, model_nbytes, skew_dim, write_model

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_model(p, TINY, progress=False)
    return p


def _w(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])


def test_layout_and_metadata(tiny_path):
    r = GGUFReader(tiny_path)
    s = TINY
    md = {k: f.contents() for k, f in r.fields.items()}
    assert md["general.architecture"] == "qwen3moe"
    expect = {"block_count": s.n_layer, "embedding_length": s.n_embd, "attention.head_count": s.n_head,
              "attention.head_count_kv": s.n_head_kv, "attention.key_length": s.head_dim,
              "attention.value_length": s.head_dim, "expert_count": s.n_expert,
              "expert_used_count": s.n_expert_used, "expert_feed_forward_length": s.n_ff_exp,
              "context_length": s.context_length}
    for k, v in expect.items():
        assert md[f"qwen3moe.{k}"] == v, k
    assert md["qwen3moe.rope.freq_base"] == pytest.approx(s.rope_theta)
    assert md["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(s.rms_eps)
    assert md["general.file_type"] == 7 and md["betelgeuse.synth.seed"] == 0
    assert len(md["tokenizer.ggml.tokens"]) == s.n_vocab == len(md["tokenizer.ggml.token_type"])
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"

    ts = {t.name: t for t in r.tensors}
    assert len(ts) == 3 + 12 * s.n_layer
    qd, kvd = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    # GGML ne order (reversed torch order) and types, as llama.cpp writes them
    shapes = {"token_embd.weight": ((s.n_embd, s.n_vocab), GT.Q8_0), "output.weight": ((s.n_embd, s.n_vocab), GT.Q8_0),
              "output_norm.weight": ((s.n_embd,), GT.F32),
              "blk.1.attn_q.weight": ((s.n_embd, qd), GT.Q8_0), "blk.1.attn_k.weight": ((s.n_embd, kvd), GT.Q8_0),
              "blk.1.attn_output.weight": ((qd, s.n_embd), GT.Q8_0),
              "blk.1.attn_q_norm.weight": ((s.head_dim,), GT.F32),
              "blk.1.ffn_gate_inp.weight": ((s.n_embd, s.n_expert), GT.F32),
              "blk.1.ffn_gate_exps.weight": ((s.n_embd, s.n_ff_exp, s.n_expert), GT.Q8_0),
              "blk.1.ffn_up_exps.weight": ((s.n_embd, s.n_ff_exp, s.n_expert), GT.Q8_0),
              "blk.1.ffn_down_exps.weight": ((s.n_ff_exp, s.n_embd, s.n_expert), GT.Q8_0)}
    for name, (shape, gt) in shapes.items():
        assert tuple(int(x) for x in ts[name].shape) == shape, name
        assert ts[name].tensor_type == gt, name
    assert sum(t.n_bytes for t in r.tensors) == model_nbytes(TINY)
    assert tiny_path.stat().st_size < 8 << 20


def test_weight_statistics(tiny_path):
    r = GGUFReader(tiny_path)
    s, j = TINY, skew_dim(TINY)
    emb = _w(r, "token_embd.weight")
    assert np.allclose(emb[:, j], 1.0, atol=0.02)                 # the constant channel
    others = np.delete(emb, j, axis=1)
    assert 0.9 < others.std() < 1.1 and abs(others.mean()) < 0.02
    for name, fan_in in [("blk.0.attn_q.weight", s.n_embd), ("blk.2.ffn_gate_exps.weight", s.n_embd),
                         ("blk.3.ffn_down_exps.weight", s.n_ff_exp), ("output.weight", s.n_embd)]:
        w = _w(r, name)
        assert abs(w.std() * fan_in ** 0.5 - 1) < 0.1, name
    down = _w(r, "blk.0.ffn_down_exps.weight")                    # (n_expert, n_embd, n_ff)
    assert np.all(down[:, j, :] == 0) and np.all(_w(r, "blk.0.attn_output.weight")[j] == 0)
    assert np.count_nonzero(down) > 0.95 * down.size
    norm = _w(r, "blk.0.ffn_norm.weight")
    assert norm[j] == 1.0 and np.all(np.abs(norm - 1) < 0.3)
    # every expert differs from the others
    assert not np.allclose(down[0], down[1])


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_same_seed_same_bytes(tmp_path, tiny_path):
    # written in another process: nothing may depend on process state (hash seeds, threads)
    code = ("from betelgeuse.gguf.synth import PRESETS, write_model; import sys;"
            "write_model(sys.argv[1], PRESETS['tiny'], progress=False)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.gguf")], check=True)
    assert _sha(tmp_path / "a.gguf") == _sha(tiny_path)
    write_model(tmp_path / "b.gguf", replace(TINY, seed=1), progress=False)
    assert _sha(tmp_path / "b.gguf") != _sha(tiny_path)
    assert not (tmp_path / "a.gguf.partial").exists()


@pytest.mark.parametrize("qtype,gt", [("F32", GT.F32), ("F16", GT.F16), ("BF16", GT.BF16)])
def test_float_qtypes(tmp_path, qtype, gt):
    spec = replace(TINY, n_layer=1, qtype=qtype)
    p = tmp_path / "m.gguf"
    write_model(p, spec, progress=False)
    r = GGUFReader(p)
    ts = {t.name: t for t in r.tensors}
    assert ts["blk.0.ffn_up_exps.weight"].tensor_type == gt
    assert ts["blk.0.ffn_gate_inp.weight"].tensor_type == GT.F32
    w = _w(r, "blk.0.ffn_up_exps.weight")
    assert abs(w.std() * spec.n_embd ** 0.5 - 1) < 0.1
    assert np.allclose(_w(r, "token_embd.weight")[:, skew_dim(spec)], 1.0, atol=0.01)


def test_bad_specs(tmp_path):
    with pytest.raises(InvalidRequestError, match="qtype"):
        write_model(tmp_path / "x.gguf", replace(TINY, qtype="Q4_K"), progress=False)
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        write_model(tmp_path / "x.gguf", replace(TINY, n_embd=48), progress=False)
    with pytest.raises(InvalidRequestError, match="n_expert_used"):
        write_model(tmp_path / "x.gguf", replace(TINY, n_expert_used=17), progress=False)
    assert not list(tmp_path.iterdir())


def _layer0_top8_share(path, spec):
    """Layer-0 routing of every vocabulary token's embedding (RMSNorm -> router -> top-k), numpy only."""
    r = GGUFReader(path)
    h = _w(r, "token_embd.weight")[: spec.n_vocab]
    x = h / np.sqrt((h ** 2).mean(-1, keepdims=True) + spec.rms_eps) * _w(r, "blk.0.ffn_norm.weight")
    logits = x @ _w(r, "blk.0.ffn_gate_inp.weight").T            # (n_vocab, n_expert)
    top = np.argsort(-logits, axis=-1)[:, : spec.n_expert_used]
    counts = np.sort(np.bincount(top.ravel(), minlength=spec.n_expert))[::-1]
    return counts[:8].sum() / counts.sum()


def test_router_skew_grows(tmp_path):
    spec = replace(TINY, n_layer=1, n_expert=64, n_expert_used=8)
    shares = []
    for s in (0.0, 0.5, 1.0, 2.0):
        p = tmp_path / f"s{s}.gguf"
        write_model(p, replace(spec, router_skew=s), progress=False)
        shares.append(_layer0_top8_share(p, spec))
    assert shares[0] < 0.25                    # uniform would be 8/64 = 0.125
    assert all(a < b for a, b in zip(shares, shares[1:])), shares
    assert shares[-1] > 0.5, shares


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    import torch
    torch.manual_seed(0)

    def load(path, spec):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32,
            moe_intermediate_size=spec.n_ff_exp, norm_topk_prob=True).eval()
    return load


def test_numerically_sane_in_transformers(tiny_path, hf):
    """Activations neither vanish nor explode; logits differ; greedy continuation is not constant."""
    import torch
    from betelgeuse.tokenizer import Tokenizer
    m = hf(tiny_path, TINY)
    ids = Tokenizer.from_file(tiny_path).encode("The river ran low that summer, and the people of the valley")
    with torch.no_grad():
        out = m(torch.tensor([ids]), output_hidden_states=True)
        gen = m.generate(torch.tensor([ids[:4]]), max_new_tokens=16, do_sample=False)
    for h in out.hidden_states:
        rms = h[0].pow(2).mean(-1).sqrt()
        assert bool(((rms > 0.3) & (rms < 10)).all()), rms
    logits = out.logits[0]
    assert torch.isfinite(logits).all() and float(logits.std(-1).min()) > 0.3
    assert len(set(logits.argmax(-1).tolist())) > len(ids) // 3
    assert len(set(gen[0, 4:].tolist())) >= 4


def test_router_skew_holds_at_depth(tmp_path, hf):
    """Expert popularity at the last layer, from transformers' own router logits over real text."""
    import torch
    from betelgeuse.gguf.synth_common import CORPUS
    from betelgeuse.tokenizer import Tokenizer
    spec = replace(TINY, n_layer=4, n_expert=32, n_expert_used=4)
    shares = []
    for s in (0.0, 1.5):
        p = tmp_path / f"d{s}.gguf"
        write_model(p, replace(spec, router_skew=s), progress=False)
        ids = Tokenizer.from_file(p).encode(" ".join(CORPUS))[:400]
        with torch.no_grad():
            rl = hf(p, spec)(torch.tensor([ids]), output_router_logits=True).router_logits
        per_layer = []
        for r in rl:
            c = np.sort(np.bincount(r.topk(spec.n_expert_used, -1).indices.ravel().numpy(),
                                    minlength=spec.n_expert))[::-1]
            per_layer.append(c[:4].sum() / c.sum())
        shares.append(per_layer)
    for l in range(spec.n_layer):
        assert shares[1][l] > shares[0][l] + 0.15, shares


def test_streaming_memory(tmp_path):
    """A ~150 MB model is written without holding it: peak RSS grows far less than the file."""
    code = (
        "import resource, sys\n"
        "from betelgeuse.gguf.synth import SynthSpec, write_model\n"
        "spec = SynthSpec(n_layer=2, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, n_expert=32,\n"
        "                 n_expert_used=4, n_ff_exp=768, n_vocab=2048)\n"
        "write_model(sys.argv[1], SynthSpec(1, 64, 4, 2, 16, 4, 2, 32, 512), progress=False)  # warm-up\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "write_model(sys.argv[1], spec, progress=False)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.gguf")], check=True,
                         capture_output=True, text=True).stdout
    size = (tmp_path / "m.gguf").stat().st_size
    assert size > 140e6
    assert int(out.strip()) < 80e6, (int(out), size)
