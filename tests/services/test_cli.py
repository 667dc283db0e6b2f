"""The `betelgeuse` CLI: real files in, real files out; every user mistake is one stderr line and
exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGMLQuantizationType

from betelgeuse.api import SamplingParams
from betelgeuse.model.generate import generate
from betelgeuse.model.qwen3moe import Qwen3MoeReference
from betelgeuse.tokenizer import Tokenizer
from services.cli import main

REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_reports_what_gguf_py_reads(tiny_model, capsys):
    rc, out, err = _run(capsys, "inspect", tiny_model)
    assert rc == 0, err
    r = GGUFReader(tiny_model)                                   # independent reader
    field = lambda k: r.fields[k].contents()
    assert "architecture:  qwen3moe" in out
    assert f"layers:        {field('qwen3moe.block_count')}" in out
    assert f"hidden:        {field('qwen3moe.embedding_length')}" in out
    assert f"{field('qwen3moe.expert_count')} per layer, {field('qwen3moe.expert_used_count')} used per token" in out
    counts = Counter(GGMLQuantizationType(t.tensor_type).name for t in r.tensors)
    assert counts["Q8_0"] > 0 and counts["F32"] > 0
    for name, n in counts.items():
        assert f"{name} x{n}" in out
    exps = [t for t in r.tensors if t.name.endswith("_exps.weight")]
    total = sum(int(t.n_bytes) for t in exps)
    assert f"expert bytes:  {total} " in out
    n_expert = field("qwen3moe.expert_count")
    layer0 = sum(int(t.n_bytes) for t in exps if t.name.startswith("blk.0.")) // n_expert
    assert f"layer   0:     expert {layer0} B" in out


def test_logits_writes_float32_tokens_by_vocab(tiny_model, tmp_path, capsys):
    out = tmp_path / "l.npy"
    rc, _, err = _run(capsys, "logits", tiny_model, "--token-ids", "1, 2,3", "--output", out)
    assert rc == 0, err
    a = np.load(out)
    n_vocab = len(GGUFReader(tiny_model).fields["tokenizer.ggml.tokens"].contents())
    assert a.dtype == np.float32 and a.shape == (3, n_vocab)
    assert np.isfinite(a).all() and a.std() > 0
    assert "APPROXIMATE" not in err
    rc, _, err = _run(capsys, "logits", tiny_model, "--token-ids", "1,2,3", "--output", out, "--routing", "pool")
    assert rc == 0 and "APPROXIMATE routing pool" in err, err


def test_generate_streams_the_decoded_completion(tiny_model, capsys):
    rc, out, err = _run(capsys, "generate", tiny_model, "--token-ids", "10,20,30", "--max-tokens", "12")
    assert rc == 0, err
    model = Qwen3MoeReference.load(tiny_model)
    tok = Tokenizer.from_metadata(model.file.metadata)
    ids = list(generate(model, [10, 20, 30], 12, SamplingParams(), stop_ids=tok.eos_ids))
    assert 0 < len(ids) <= 12
    assert out == tok.decode(ids) + "\n"


def test_generate_prompt_text_and_seeded_sampling_reproduce(tiny_model, capsys):
    argv = ["generate", tiny_model, "--prompt", "Hello there", "--max-tokens", "8",
            "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "11", "--ignore-eos"]
    rc1, out1, err1 = _run(capsys, *argv)
    rc2, out2, _ = _run(capsys, *argv)
    assert rc1 == rc2 == 0, err1
    assert out1 == out2 and len(out1) > 1


def test_generate_stops_before_a_stop_string(tiny_model, capsys):
    rc, full, _ = _run(capsys, "generate", tiny_model, "--token-ids", "10,20,30", "--max-tokens", "12", "--ignore-eos")
    assert rc == 0
    text = full[:-1]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    rc, out, _ = _run(capsys, "generate", tiny_model, "--token-ids", "10,20,30", "--max-tokens", "12",
                      "--ignore-eos", "--stop", stop)
    assert rc == 0
    assert out == text[:text.index(stop)] + "\n"


def test_synth_writes_the_requested_geometry(tmp_path, capsys):
    out = tmp_path / "s.gguf"
    rc, _, err = _run(capsys, "synth", out, "--preset", "tiny", "--layers", "1", "--qtype", "F32",
                      "--seed", "5", "--no-progress")
    assert rc == 0, err
    r = GGUFReader(out)
    assert r.fields["qwen3moe.block_count"].contents() == 1
    assert {GGMLQuantizationType(t.tensor_type).name for t in r.tensors} == {"F32"}


def _bad_inputs(model: Path, tmp: Path) -> list[tuple[list, str]]:
    not_gguf = tmp / "not.gguf"
    not_gguf.write_text("hello, not a model\n")
    truncated = tmp / "trunc.gguf"
    truncated.write_bytes(model.read_bytes()[:5000])
    logits = lambda m, ids: ["logits", m, "--token-ids", ids, "--output", tmp / "o.npy"]
    gen = lambda *a: ["generate", model, "--token-ids", "1,2", *a]
    return [
        (logits(model, "1,x,3"), "not an integer"),
        (logits(model, ","), "empty"),
        (logits(model, "1,999999"), "out of range"),
        (logits(model, "-1"), "out of range"),
        (logits(tmp / "missing.gguf", "1"), "missing.gguf"),
        (logits(not_gguf, "1"), "not a GGUF file"),
        (logits(truncated, "1"), "trunc"),
        (logits(tmp, "1"), str(tmp)),
        (["logits", model, "--token-ids", "1", "--output", tmp / "no" / "dir" / "o.npy"], "cannot write"),
        (["inspect", not_gguf], "not a GGUF file"),
        (gen("--temperature", "-1"), "temperature"),
        (gen("--temperature", "1", "--top-p", "0"), "top_p"),
        (gen("--temperature", "1", "--top-k", "-2"), "top_k"),
        (gen("--max-tokens", "-1"), "--max-tokens must be >= 1"),
        (gen("--max-tokens", "ten"), "invalid int"),
        (["generate", model], "--prompt"),
        (["generate", model, "--prompt", "a", "--token-ids", "1"], "not allowed"),
        (["frobnicate"], "invalid choice"),
        (["logits", model], "required"),
        (["synth", tmp / "x.gguf", "--qtype", "Q2_K", "--no-progress"], "qtype"),
        (["synth", tmp / "x.gguf", "--preset", "huge"], "invalid choice"),
    ]


def test_every_bad_input_is_one_line_and_exit_2(tiny_model, tmp_path, capsys):
    for argv, fragment in _bad_inputs(tiny_model, tmp_path):
        rc, out, err = _run(capsys, *argv)
        lines = err.strip().splitlines()
        assert rc == 2, (argv, err)
        assert len(lines) == 1 and lines[0].startswith("betelgeuse: error: "), (argv, err)
        assert fragment in lines[0], (argv, lines[0])
        assert "Traceback" not in err and out == "", argv


@pytest.mark.parametrize("args, fragment", [
    (["logits", "{model}", "--token-ids", "1,2,zz", "--output", "{tmp}/o.npy"], "not an integer"),
    (["inspect", "{tmp}/missing.gguf"], "missing.gguf"),
])
def test_real_process_reports_one_line(args, fragment, tiny_model, tmp_path):
    argv = [a.format(model=tiny_model, tmp=tmp_path) for a in args]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("betelgeuse: error: ") and fragment in lines[0], p.stderr


# A bad value of every engine setting (the keys that feed EngineConfig), as a flag, a TOML key and an environment
# variable: serve refuses it in one line naming where it came from and what is allowed, exit 2, before it starts
# anything. (key, the bad value as TOML holds it, a fragment of the allowed values)
BAD_ENGINE_VALUES = [
    ("slots.vram_per_layer", -1, '>= 0 or "auto"'),
    ("slots.host_per_layer", "many", '>= 0 or "auto"'),
    ("slots.vram_backing", "maybe", 'true, false or "auto"'),
    ("budget.vram", "lots", "cannot parse size"),
    ("budget.memory_max", "12 bananas", "cannot parse size"),
    ("engine.schedule", "fast", "layer_major, standard"),
    ("engine.routing", "fuzzy", "exact, resident, pool"),
    ("engine.sub_batch", 0, "integer >= 1"),
    ("engine.micro_batch", 0, "integer >= 1"),
    ("engine.staging_slots", -1, '>= 0 or "auto"'),
    ("engine.ring_slots", 1, "integer >= 2"),
    ("engine.kernels", "cuda", "auto, torch, triton"),
    ("engine.act_quant", "int4", "off, q8_1, bf16, auto"),
    ("engine.pack_experts", "packed", "true or false"),
    ("engine.tile_experts", "tiled", "true or false"),
    ("engine.decode_consolidate_every", -1, "integer >= 0"),
    ("engine.cuda_graphs", "maybe", "true or false"),
    ("engine.prefetch", 1, "true or false"),
    ("engine.prefetch_decode", "yes", "true or false"),
    ("engine.prefetch_host", "yes", "auto, on, off"),
    ("engine.prefetch_hash", "yes", "true or false"),
    ("engine.flex_cache", "maybe", 'true, false or "auto"'),
    ("engine.flex_cache", 1, 'true, false or "auto"'),
    ("engine.decode_at_hand", "sometimes", 'true, false or "auto"'),
    ("engine.decode_gate", "fast", "off, on, auto"),
    ("engine.host_in_place", "sometimes", "auto, always, never"),
    ("engine.group_graphs", "maybe", "true or false"),
    ("engine.recycle_states", "maybe", "true or false"),
    ("engine.decode_fold", "maybe", "true or false"),
    ("engine.decode_gemv", "sometimes", "true or false"),
    ("engine.stream_points", "often", "true or false"),
    ("engine.disk_flush_early", "soon", "true or false"),
    ("engine.disk_copy_early", "early", "true or false"),
    ("engine.warm_up", "maybe", "on, off"),
    ("engine.prefetch_depth", 0, "integer >= 1"),
    ("engine.prefetch_depth", "deep", '>= 1 or "auto"'),
    ("engine.prefetch_batch_rule", "all", "rows, union, ranks"),
    ("engine.prefetch_min_hit", 1.5, "between 0 and 1"),
    ("engine.prefetch_min_hit", -0.25, "between 0 and 1"),
    ("engine.prefetch_min_hit", "half", "between 0 and 1"),
    ("engine.max_context", 4, "integer >= 8"),
    ("engine.max_running", 0, '>= 1 or "auto"'),
    ("engine.admission_window", -1, "seconds >= 0"),
    ("engine.max_queue", -1, "integer >= 0"),
    ("engine.max_batched_tokens", 0, "integer >= 1"),
    ("engine.prefill_chunk", 0, "integer >= 1"),
    ("engine.prefix_cache_bytes", "lots", "cannot parse size"),
    ("engine.prefix_host_bytes", -1, "cannot be negative"),
    ("engine.dtype", "float8", "auto, float32, bfloat16, float16"),
    ("engine.worker_reserve", "lots", "cannot parse size"),
    ("engine.read_threads", 0, "integer >= 1"),
    ("engine.read_request_bytes", "1 page", "cannot parse size"),
    ("engine.session_reads", "often", "true or false"),
    ("engine.placement_hysteresis", "some", "true or false"),
    ("engine.fill_budget", "sometimes", "true or false"),
    ("engine.engram_cache_bytes", "lots", "cannot parse size"),
    ("engine.engram_read_depth", 0, "integer >= 1"),
    ("engine.max_prompt_bytes", "lots", "cannot parse size"),
    ("engine.tokenize_threads", 0, "integer >= 1"),
]
# engine keys any string is valid for at parse time (a path; the device, resolved when the engine starts)
FREE_ENGINE_KEYS = {"model.path", "worker.device", "engine.record_routing"}


def test_every_engine_setting_has_a_bad_value_row():
    """A key that feeds EngineConfig and has no row above fails here: a new setting comes with its bad value."""
    from betelgeuse.settings import KEYS_INFO
    engine_keys = {k.name for k in KEYS_INFO if k.engine} - FREE_ENGINE_KEYS
    assert engine_keys == {key for key, _, _ in BAD_ENGINE_VALUES}


@pytest.mark.parametrize("route", ["flag", "toml", "env"])
@pytest.mark.parametrize("key, bad, allowed", BAD_ENGINE_VALUES, ids=lambda v: str(v))
def test_bad_engine_setting_is_one_line_and_exit_2(key, bad, allowed, route, tmp_path, capsys,
                                                   monkeypatch):
    from betelgeuse.settings import BY_KEY
    k = BY_KEY[tuple(key.split("."))]
    text = str(bad).lower() if isinstance(bad, bool) else str(bad)      # the value as a flag or variable holds it
    # a model that is not there: were the value let through, serve fails on the model at once (another message)
    # instead of starting a store and a worker that would hang the test
    argv = ["serve", tmp_path / "absent.gguf", "--runtime-dir", tmp_path / "rt"]
    if route == "flag":
        if k.is_bool:
            pytest.skip("a plain on/off flag (--KEY / --no-KEY) takes no value")
        argv += [f"{k.flag}={text}"]
        where = f"flag {k.flag} ({key})"
    elif route == "toml":
        section, name = key.split(".")
        (tmp_path / "b.toml").write_text(f"[{section}]\n{name} = {json.dumps(bad)}\n")
        argv += ["--config", tmp_path / "b.toml"]
        where = f"b.toml: {key}"
    else:
        monkeypatch.setenv(k.env, text)
        where = f"env {k.env}"
    rc, out, err = _run(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and "Traceback" not in err, (argv, err)
    assert len(lines) == 1 and lines[0].startswith("betelgeuse: error: "), err
    assert where in lines[0] and allowed in lines[0], lines[0]
    assert not (tmp_path / "rt").exists()                  # refused before anything started
