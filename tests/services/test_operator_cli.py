"""The small things an operator hits first (issue 12): demo says its weights are random; inspect shows
the header of any GGUF file (checked against gguf-py's own reader) and says why one cannot be served;
bench says before it writes a second model; serve has --host, keeps its logs when a child dies and
prints the error once; `generate --server` is a thin client (no torch imported) that refuses engine
flags; the cuda_version label is the same in both processes; the README's model table matches the code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from services.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _cli(*argv, timeout=120, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "services.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    """A GGUF Betelgeuse cannot serve (a llama, with an IQ-type tensor), written by gguf-py's writer."""
    import gguf
    path = tmp_path_factory.mktemp("llama") / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_tensor("token_embd.weight", np.zeros((300, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_demo_says_random_weights(capsys):
    rc, out, err = _run(capsys, "demo", "--max-tokens", "0")       # stops at the first check, writes nothing
    assert rc == 2 and "--max-tokens" in err
    assert "random weights" in err and "gibberish" in err
    rc, out, err = _run(capsys, "--help")
    assert "random-weight" in out


def test_inspect_shows_any_header(llama_gguf, capsys):
    from gguf import GGUFReader
    rc, out, err = _run(capsys, "inspect", llama_gguf)
    assert rc == 0, err
    r = GGUFReader(str(llama_gguf))                                  # independent reader
    assert f"version {r.fields['GGUF.version'].contents()}" in out
    assert f"{len(r.tensors)} tensors" in out
    assert "general.architecture = 'llama'" in out
    assert "llama.block_count = 2" in out and "llama.context_length = 128" in out
    assert "tokenizer.ggml.tokens = [300 x string: 'tok0', 'tok1', 'tok2', ...]" in out
    assert "F32 x1" in out and "F16 x1" in out
    assert "servable:      no, architecture 'llama'" in out and "qwen3moe" in out


def test_inspect_servable_model(tiny_model, capsys):
    rc, out, err = _run(capsys, "inspect", tiny_model)
    assert rc == 0, err
    assert "servable:      yes" in out and "general.architecture = 'qwen3moe'" in out


def test_inspect_not_a_gguf(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" * 16)
    rc, out, err = _run(capsys, "inspect", bad)
    assert rc == 2 and err.count("betelgeuse: error:") == 1 and "Traceback" not in err


def test_bench_says_before_writing_a_second_model(tmp_path, monkeypatch, capsys):
    from services.bench import cli as bench_cli

    class Stop(Exception):
        pass

    def refuse(path, spec, log):
        raise Stop(str(path))
    monkeypatch.setattr(bench_cli, "ensure_model", refuse)          # nothing is written
    with pytest.raises(Stop):
        main(["bench", "--work-dir", str(tmp_path), "--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    m = re.search(r"this run also writes a second model, (\S+) \(([0-9.]+) GB", err)
    assert m, err
    assert "--variant-skew none skips it" in err and not Path(m.group(1)).exists()


def test_generate_server_is_a_thin_client():
    code = ("import sys; from services.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', rc)")
    from services.launcher import free_port
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code, "generate", "--server", f"127.0.0.1:{free_port()}", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout.split() == ["NOTORCH", "2"], r.stdout + r.stderr      # nobody listens: a clean error
    assert r.stderr.count("betelgeuse: error:") == 1 and "UNAVAILABLE" in r.stderr
    for flags, named in ((["--device", "cuda"], "--device"), (["--host-slots", "3", "--engine", "in-process"], "--host-slots"),
                         (["model.gguf"], "MODEL"), (["--no-vram-backing"], "--no-vram-backing")):
        r = _cli("generate", "--server", "127.0.0.1:1", "--prompt", "hi", *flags)
        assert r.returncode == 2 and "not with --server" in r.stderr and named in r.stderr, r.stderr


def test_generate_server_streams_from_a_real_server(service_model_cluster):
    r = _cli("generate", "--server", service_model_cluster.address, "--prompt", "Hello", "--max-tokens", "3",
             "--ignore-eos", "--usage")
    assert r.returncode == 0, r.stderr
    assert "generated 3 tok" in r.stderr


@pytest.fixture(scope="module")
def service_model_cluster(tmp_path_factory, tiny_model):
    from services.launcher import Cluster
    c = Cluster(str(tiny_model), str(tmp_path_factory.mktemp("run")), worker_metrics="", store_metrics="")
    try:
        c.start_store()
        c.start_worker()
        yield c
    finally:
        c.stop()


def test_launcher_host():
    import tempfile
    from services.launcher import Cluster
    with tempfile.TemporaryDirectory() as d:
        c = Cluster("m.gguf", d, port=5555, host="0.0.0.0")
        assert c.listen == "0.0.0.0:5555" and c.address == "127.0.0.1:5555"
        c = Cluster("m.gguf", d, port=5555, host="::1")
        assert c.listen == "[::1]:5555" and c.address == "[::1]:5555"


def _children(pid: int) -> dict[str, int]:
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:                                          # a thread (or a child) may end while we look
            kids = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for k in kids:
            try:
                cmd = Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")
            except FileNotFoundError:
                continue
            for name in ("store", "worker"):
                if f"services.{name}_main" in cmd:
                    out[name] = int(k)
    return out


def test_serve_host_keeps_logs_when_a_child_dies(tiny_model):
    from services.launcher import free_port
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", str(tiny_model), "--host", "127.0.0.1",
                          "--port", str(port), "--worker-metrics", "127.0.0.1:0", "--store-metrics", "127.0.0.1:0",
                          # HTTP on a port of its own: the default 127.0.0.1:8000 is one port for every test process
                          "--http", f"127.0.0.1:{free_port()}"],
                         env=env, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        lines = []
        t0 = time.monotonic()
        while not any(l.startswith("try:") for l in lines):
            line = p.stderr.readline()
            assert line or p.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() - t0 < 180, "".join(lines)
        assert any(f"gRPC     127.0.0.1:{port}" in l for l in lines), lines
        logs_dir = next(l.split()[1] for l in lines if l.strip().startswith("logs"))
        logs_dir = os.path.dirname(logs_dir)
        kids = _children(p.pid)
        assert set(kids) == {"store", "worker"}, kids
        os.kill(kids["store"], signal.SIGKILL)                       # the store dies: serve names it, restarts it
        t0 = time.monotonic()
        while not any("store restarted" in l for l in lines):
            line = p.stderr.readline()
            assert line or p.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() - t0 < 120, "".join(lines)
        said = "".join(lines)
        assert f"the store (pid {kids['store']})" in said and "restarting it" in said, said
        assert (Path(logs_dir) / "store.log").exists() and (Path(logs_dir) / "worker.log").exists()
        p.send_signal(signal.SIGTERM)
        rest = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, rest                                   # a clean SIGTERM after the restart
    assert "betelgeuse: error:" not in said + rest, said + rest


def test_serve_start_failure_prints_one_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" * 16)
    r = _cli("serve", bad, "--runtime-dir", tmp_path / "run", "--port", "0", "--worker-metrics", "127.0.0.1:0",
             "--store-metrics", "127.0.0.1:0")
    assert r.returncode == 2, r.stderr
    errs = [l for l in r.stderr.splitlines() if "error:" in l]
    assert len(errs) == 1 and errs[0].startswith("betelgeuse: error: the store (pid") \
        and errs[0].count("error:") == 1, r.stderr
    assert "not a GGUF" in errs[0] or "GGUF" in errs[0], errs
    assert (tmp_path / "run" / "store.log").exists() and f"logs kept in {tmp_path / 'run'}" in r.stderr


def test_cuda_version_label_agrees():
    """Both registries report the CUDA build torch was made for, without the store importing torch."""
    from betelgeuse import metrics as bm
    code = ("import sys; from betelgeuse import metrics as bm; r = bm.make_store_metrics(); "
            "v = [s for f in r.registry.collect() if f.name == 'betelgeuse_build' for s in f.samples][0].labels; "
            "print(v['cuda_version'], 'torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    store_cuda, imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                          timeout=60, check=True).stdout.split()
    assert imported == "False"
    import torch
    assert store_cuda == (torch.version.cuda or "none")               # the reference: torch itself
    w = bm.make_worker_metrics()
    labels = [s for f in w.registry.collect() if f.name == "betelgeuse_build" for s in f.samples][0].labels
    assert labels["cuda_version"] == store_cuda


def test_readme_model_table_matches_the_code():
    from betelgeuse.gguf import SUPPORTED_ARCHS
    from betelgeuse.gguf.qtypes import SUPPORTED_QTYPES, qtype_name
    from betelgeuse.gguf.vocab import PRE_SPLITS
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Models"):]
    table = table[:table.index("Where to get one")]
    rows = {l.split("|")[1].strip(): l.split("|")[2] for l in table.splitlines() if l.startswith("| ") and "---" not in l}
    archs = next(v for k, v in rows.items() if k.startswith("architectures"))
    assert set(re.findall(r"`(\w+)`", archs)) == set(SUPPORTED_ARCHS)
    types = next(v for k, v in rows.items() if k.startswith("tensor types"))
    listed = set(re.findall(r"\b(F32|F16|BF16|I32|Q\d_\w+|MXFP4|IQ\w+)\b", types.split("(")[0]))
    assert listed == {qtype_name(q) for q in SUPPORTED_QTYPES}
    toks = next(v for k, v in rows.items() if k.startswith("tokenizers"))
    assert set(PRE_SPLITS) <= set(re.findall(r"`([\w-]+)`", toks))
    assert "hf download" in text and "random weights" in text
