"""`betelgeuse synth --qtype`: models whose experts are K- and i-quants (random valid blocks, gguf-py cannot quantize
to them), the Q4_K_M-like mix, deepseek4 with Q2_K experts; read back with gguf's own reader and dequantizer."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from betelgeuse.errors import InvalidRequestError
from betelgeuse.gguf.quants_synth import BLOCK_TYPES
from betelgeuse.gguf.synth import skew_dim, spec_from_preset, write_model

GEOM = dict(n_embd=256, n_ff_exp=256, n_head=4, head_dim=64, n_layer=2, n_expert=8)   # K-quant rows: 256-multiples


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def _w(path, name) -> np.ndarray:
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_expert_qtypes(tmp_path, qtype):
    spec = spec_from_preset("tiny", qtype=qtype, **GEOM)
    path = tmp_path / f"{qtype}.gguf"
    write_model(path, spec, progress=False)
    types = _types(path)
    assert {types[f"blk.{i}.ffn_{k}_exps.weight"] for i in range(2) for k in ("gate", "up", "down")} == {qtype}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "Q8_0"
    gate = _w(path, "blk.1.ffn_gate_exps.weight")                     # [E, F, H] by gguf-py's dequantizer
    assert np.isfinite(gate).all() and abs(gate.std() / (256 ** -0.5) - 1) < 0.25 and abs(gate.mean()) < 0.01
    down = _w(path, "blk.0.ffn_down_exps.weight")                     # [E, H, F]: the constant channel's row is 0
    assert (down[:, skew_dim(spec)] == 0).all() and (np.abs(down).sum(axis=2) > 0).sum() == 8 * 255
    assert GGUFReader(path).fields["general.file_type"].contents() == BLOCK_TYPES[qtype]
    from betelgeuse.kernels.moe import MoEKernels
    assert MoEKernels.supports([(int(t.tensor_type), int(t.tensor_type))
                                for t in GGUFReader(path).tensors if t.name.endswith("gate_exps.weight")])
    if qtype in ("Q4_K", "Q3_K", "IQ2_XXS"):         # the model runs (the torch reference path; ~1 s each)
        from betelgeuse.model import reference_model
        m = reference_model(str(path))
        with torch.no_grad():
            logits = m.forward(torch.tensor([5, 17, 300, 2]), m.new_cache(8))
        assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_q4_k_m_mix_and_inspect(tmp_path, capsys, monkeypatch):
    path = tmp_path / "mix.gguf"
    write_model(path, spec_from_preset("tiny", qtype="Q4_K_M", **GEOM), progress=False)
    t = _types(path)
    assert t["blk.0.ffn_gate_exps.weight"] == t["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert t["blk.0.attn_q.weight"] == t["blk.0.attn_k.weight"] == t["blk.1.attn_output.weight"] == "Q6_K"
    assert t["blk.0.attn_v.weight"] == t["token_embd.weight"] == "Q8_0" and t["output.weight"] == "Q6_K"
    assert t["blk.0.ffn_gate_inp.weight"] == t["blk.0.attn_norm.weight"] == "F32"
    # inspect names the path of each tensor type: the experts' GPU kernel, the rest dequantized at load
    from services.cli import main
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  experts Q4_K     GPU kernel (Triton" in out and "other   F32, Q6_K, Q8_0: dequantized once at load" in out
    assert "with --act-quant q8_1: int8 tensor cores" in out
    from betelgeuse.kernels import kinds
    monkeypatch.setattr(kinds, "TRITON_QTYPES", kinds.TRITON_QTYPES - {12})     # a type without a kernel: said so
    assert main(["inspect", str(path)]) == 0
    assert "  experts Q4_K     torch path (dequantized per expert" in capsys.readouterr().out


def test_deepseek4_q2_k_experts(tmp_path):
    """ds4 with Q2_K routed experts via the CLI's --qtype (deepseek4: the experts' type)."""
    path = tmp_path / "ds4.gguf"
    subprocess.run([sys.executable, "-m", "services.cli", "synth", str(path), "--preset", "ds4-tiny", "--qtype",
                    "Q2_K", "--hidden", "256", "--ff", "256", "--no-progress"], check=True, capture_output=True)
    t = _types(path)
    assert {v for k, v in t.items() if "_exps." in k} == {"Q2_K"} and "Q8_0" in t.values()
    from betelgeuse.model import reference_model
    m = reference_model(str(path))
    with torch.no_grad():
        assert torch.isfinite(m.forward(torch.tensor([5, 17, 300]), m.new_cache(8))).all()


def test_bad_geometry_is_named():
    with pytest.raises(InvalidRequestError, match="n_embd=64 must be a multiple of 256 for Q4_K"):
        write_model("/nonexistent/x.gguf", spec_from_preset("tiny", qtype="Q4_K"), progress=False)
    with pytest.raises(InvalidRequestError, match="qtype 'Q4_0' not supported"):
        write_model("/nonexistent/x.gguf", spec_from_preset("tiny", qtype="Q4_0"), progress=False)
    with pytest.raises(InvalidRequestError, match="multiples of 256 for IQ2_XXS experts"):
        write_model("/nonexistent/x.gguf", spec_from_preset("ds4-tiny", qtype="IQ2_XXS"), progress=False)
