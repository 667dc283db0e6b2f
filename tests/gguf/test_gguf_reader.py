"""GGUFModelFile against tiny qwen3moe files written here with gguf's own GGUFWriter.

References are independent of the reader under test: the arrays we wrote (F32), gguf-py's numpy
quantize/dequantize (Q8_0), and plain os.pread of the file for the expert byte ranges.
"""

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from betelgeuse.errors import ModelFormatError, UnsupportedError
from betelgeuse.gguf import GGUFModelFile, dequantize

V, E, L, H, HKV, D, X, K, F = 64, 32, 2, 4, 2, 8, 8, 2, 16  # vocab, embd, layers, heads, kv, head_dim, experts, top-k, ff


def geometry() -> dict[str, tuple[int, ...]]:
    """Tensor name -> torch-order shape of the tiny model (llama.cpp qwen3moe layout)."""
    g = {"token_embd.weight": (V, E), "output_norm.weight": (E,), "output.weight": (V, E)}
    for i in range(L):
        b = f"blk.{i}."
        g |= {b + "attn_norm.weight": (E,), b + "attn_q.weight": (H * D, E), b + "attn_k.weight": (HKV * D, E),
              b + "attn_v.weight": (HKV * D, E), b + "attn_output.weight": (E, H * D),
              b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,), b + "ffn_norm.weight": (E,),
              b + "ffn_gate_inp.weight": (X, E), b + "ffn_gate_exps.weight": (X, F, E),
              b + "ffn_up_exps.weight": (X, F, E), b + "ffn_down_exps.weight": (X, E, F)}
    return g


def write_model(path, qtype=QT.F32, *, arch="qwen3moe", drop=(), shapes=None, qtypes=None, fused=False,
                name="tiny-test", seed=0) -> dict[str, np.ndarray]:
    """Write a tiny model; returns name -> the dequantized values a correct reader must produce.
    `qtype` applies to 2-D/3-D weights (1-D norms stay F32, as llama.cpp writes them);
    `qtypes` overrides per tensor, `shapes` overrides shapes, `drop` omits tensors."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_expert_feed_forward_length(F)
    w.add_expert_count(X)
    w.add_expert_used_count(K)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("no_vocab")
    w.add_array("test.strings", ["a", "é", "<0xFF>"])
    w.add_array("test.ints", [3, 1, 2])
    g = geometry()
    g.update(shapes or {})
    if fused:
        for i in range(L):
            g[f"blk.{i}.ffn_gate_up_exps.weight"] = (X, 2 * F, E)
            del g[f"blk.{i}.ffn_gate_exps.weight"], g[f"blk.{i}.ffn_up_exps.weight"]
    expect = {}
    for name, shape in g.items():
        if name in drop:
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        # like llama.cpp's quantizer: 1-D norms and rows that are not whole blocks stay F32
        # (here ffn_down_exps, whose rows are n_ff = 16 elements)
        whole_blocks = shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
        qt = (qtypes or {}).get(name, qtype if len(shape) > 1 and whole_blocks else QT.F32)
        if qt == QT.F32:
            w.add_tensor(name, x)
            expect[name] = x
        else:
            q = gguf.quants.quantize(x, qt)
            w.add_tensor(name, q, raw_dtype=qt)
            expect[name] = gguf.quants.dequantize(q, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


@pytest.fixture(params=[QT.F32, QT.Q8_0], ids=["F32", "Q8_0"])
def model(request, tmp_path):
    path = tmp_path / "tiny.gguf"
    expect = write_model(path, request.param)
    with GGUFModelFile.open(path) as m:
        yield m, expect, request.param


def test_config(model):
    m, _, _ = model
    c = m.config
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim) == ("qwen3moe", L, E, H, HKV, D)
    assert (c.n_ff_exp, c.n_expert, c.n_expert_used, c.n_vocab, c.context_length) == (F, X, K, V, 256)
    assert c.rope_theta == 1e6 and c.rms_eps == pytest.approx(1e-6) and c.norm_topk_prob is True
    assert c.name == "tiny-test"
    assert m.metadata["general.architecture"] == "qwen3moe"
    assert m.metadata["tokenizer.ggml.model"] == "no_vocab"
    assert m.metadata["qwen3moe.block_count"] == L
    assert m.metadata["test.strings"] == ["a", "é", "<0xFF>"] and m.metadata["test.ints"] == [3, 1, 2]
    assert type(m.metadata["qwen3moe.rope.freq_base"]) is float and type(m.metadata["qwen3moe.context_length"]) is int


def test_tensors_load_to_reference_values(model):
    m, expect, qtype = model
    assert set(m.tensors) == set(expect)
    for name, ref in expect.items():
        info = m.tensors[name]
        assert info.shape == ref.shape
        t = m.load_tensor(name)
        assert t.dtype == torch.float32 and tuple(t.shape) == ref.shape
        np.testing.assert_array_equal(t.numpy(), ref)
    assert m.tensors["blk.0.ffn_gate_exps.weight"].qtype == int(qtype)
    assert m.load_tensor("token_embd.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_raw_is_the_file_bytes(model):
    m, _, _ = model
    info = m.tensors["blk.1.attn_q.weight"]
    with open(m.path, "rb") as f:
        want = os.pread(f.fileno(), info.nbytes, info.offset)
    raw = m.raw("blk.1.attn_q.weight")
    assert raw.dtype == np.uint8 and raw.shape == (info.nbytes,) and raw.tobytes() == want
    assert not raw.flags.writeable


def test_expert_byte_ranges(model):
    m, expect, qtype = model
    with open(m.path, "rb") as f:
        fd = f.fileno()
        for layer in range(L):
            total = 0
            for e in range(X):
                parts = m.expert_parts(layer, e)
                assert [p.kind for p in parts] == ["gate", "up", "down"]
                assert [p.shape for p in parts] == [(F, E), (F, E), (E, F)]
                for p, t in zip(parts, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                    assert p.qtype == m.tensors[f"blk.{layer}.{t}.weight"].qtype
                    raw = torch.frombuffer(bytearray(os.pread(fd, p.nbytes, p.offset)), dtype=torch.uint8)
                    got = dequantize(raw, p.qtype, p.shape)
                    np.testing.assert_array_equal(got.numpy(), expect[f"blk.{layer}.{t}.weight"][e])
                total = sum(p.nbytes for p in parts)
            assert m.expert_nbytes(layer) == total
            gate_row = 4 * E if qtype == QT.F32 else E // 32 * 34   # bytes of one row of n_embd
            assert total == 2 * F * gate_row + E * 4 * F              # down rows of n_ff stay F32
    with pytest.raises(IndexError):
        m.expert_parts(0, X)


def test_fused_gate_up(tmp_path):
    path = tmp_path / "fused.gguf"
    expect = write_model(path, QT.Q8_0, fused=True)
    with GGUFModelFile.open(path) as m, open(path, "rb") as f:
        assert m.config.n_ff_exp == F and m.config.n_expert == X
        for e in (0, 3, X - 1):
            gate, up, down = m.expert_parts(1, e)
            fused = expect["blk.1.ffn_gate_up_exps.weight"][e]  # (2F, E): gate rows then up rows
            for p, ref in ((gate, fused[:F]), (up, fused[F:]), (down, expect["blk.1.ffn_down_exps.weight"][e])):
                raw = torch.frombuffer(bytearray(os.pread(f.fileno(), p.nbytes, p.offset)), dtype=torch.uint8)
                np.testing.assert_array_equal(dequantize(raw, p.qtype, p.shape).numpy(), ref)
            assert gate.offset + gate.nbytes == up.offset


def test_tied_output_falls_back_to_token_embd(tmp_path):
    path = tmp_path / "tied.gguf"
    expect = write_model(path, drop={"output.weight"})
    with GGUFModelFile.open(path) as m:
        assert m.tied_output and "output.weight" not in m.tensors
        np.testing.assert_array_equal(m.load_tensor("output.weight").numpy(), expect["token_embd.weight"])


def test_name_falls_back_to_stem(tmp_path):
    path = tmp_path / "my-model.gguf"
    write_model(path, name=None)
    with GGUFModelFile.open(path) as m:
        assert m.config.name == "my-model"


# ---- bad inputs: the right error class, one line naming the problem ----------------------------

def test_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        GGUFModelFile.open(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello, this is not a model\n")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFModelFile.open(p)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFModelFile.open(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.02])
def test_truncated(tmp_path, keep):
    p = tmp_path / "t.gguf"
    write_model(p, QT.Q8_0)
    size = p.stat().st_size
    os.truncate(p, int(size * keep))
    with pytest.raises(ModelFormatError, match="truncated") as ei:
        GGUFModelFile.open(p)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)
    if keep > 0.1:  # cut inside the tensor data: the message names the first tensor past the end
        assert f"the file has {int(size * keep)} bytes" in str(ei.value) and "weight' ends at byte" in str(ei.value)


def test_wrong_arch(tmp_path):
    p = tmp_path / "llama.gguf"
    write_model(p, arch="llama")
    with pytest.raises(UnsupportedError, match="architecture 'llama'"):
        GGUFModelFile.open(p)


def test_unsupported_qtype(tmp_path):
    p = tmp_path / "q4_0.gguf"
    write_model(p, qtypes={"blk.1.ffn_up_exps.weight": QT.Q4_0})
    with pytest.raises(UnsupportedError, match=r"'blk.1.ffn_up_exps.weight'.*Q4_0"):
        GGUFModelFile.open(p)


@pytest.mark.parametrize("name", ["token_embd.weight", "output_norm.weight", "blk.1.attn_k_norm.weight",
                                  "blk.0.ffn_gate_inp.weight", "blk.1.ffn_up_exps.weight",
                                  "blk.0.ffn_down_exps.weight"])
def test_missing_tensor(tmp_path, name):
    p = tmp_path / "m.gguf"
    write_model(p, drop={name})
    with pytest.raises(ModelFormatError, match=f"'{name}' is missing"):
        GGUFModelFile.open(p)


@pytest.mark.parametrize("name,shape", [("blk.1.attn_q.weight", (H * D + 8, E)),
                                        ("blk.0.ffn_down_exps.weight", (X, E, 2 * F)),
                                        ("blk.1.ffn_gate_inp.weight", (X + 1, E)),
                                        ("blk.0.attn_q_norm.weight", (D * 2,)),
                                        ("output.weight", (V + 1, E))])
def test_shape_mismatch(tmp_path, name, shape):
    p = tmp_path / "s.gguf"
    write_model(p, shapes={name: shape})
    with pytest.raises(ModelFormatError) as ei:
        GGUFModelFile.open(p)
    msg = str(ei.value)
    assert name in msg and str(list(shape)) in msg and "expected" in msg
    assert not isinstance(ei.value, UnsupportedError)


def test_n_ff_metadata_disagrees_with_tensor(tmp_path):
    p = tmp_path / "ff.gguf"
    write_model(p, shapes={f"blk.{i}.ffn_{k}_exps.weight": (X, 2 * F, E) for i in range(L) for k in ("gate", "up")})
    with pytest.raises(ModelFormatError, match=r"ffn_gate_exps.*\[8, 32, 32\].*expected \[8, 16, 32\]"):
        GGUFModelFile.open(p)


def test_expert_count_disagrees(tmp_path):
    p = tmp_path / "x.gguf"
    write_model(p, shapes={f"blk.{i}.ffn_{k}_exps.weight": (X // 2, F, E) for i in range(L) for k in ("gate", "up")})
    with pytest.raises(ModelFormatError, match="expert_count"):
        GGUFModelFile.open(p)
