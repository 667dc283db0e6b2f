"""`betelgeuse serve`: both processes come up behind one command, answer over gRPC, and go away with it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.client import generate_stream
import grpc
from grpc_health.v1 import health_pb2

from service_helpers import health_status, wait_health
from services.launcher import free_port

REPO = Path(__file__).resolve().parents[1]


def _children_of(runtime_dir: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if runtime_dir in cmd and "services." in cmd:
                pids.append(int(d))
    return pids


def test_serve_starts_both_processes_and_stops_them(tmp_path):
    from betelgeuse.gguf.synth import PRESETS, write_model
    model = tmp_path / "tiny.gguf"
    write_model(model, PRESETS["tiny"], progress=False)
    port, http, run = free_port(), free_port(), str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "betelgeuse.cli", "serve", str(model), "--port", str(port),
                          "--runtime-dir", run, "--worker-metrics", "127.0.0.1:0", "--store-metrics", "127.0.0.1:0",
                          "--http", f"127.0.0.1:{http}"],
                         env=env, stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert wait_health(ch, health_pb2.HealthCheckResponse.SERVING, timeout=120) == \
                health_pb2.HealthCheckResponse.SERVING
        events = list(generate_stream(f"127.0.0.1:{port}", prompt_text="Hello", max_tokens=4, ignore_eos=True))
        assert events[-1].final.usage.predicted_n == 4
        import urllib.request                              # the OpenAI-compatible HTTP API is up too
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10) as r:
            assert r.status == 200
        kids = _children_of(run)
        assert len(kids) == 2, kids                       # the store and the worker
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) != 0                    # KeyboardInterrupt exit (130)
        deadline = time.monotonic() + 10
        while _children_of(run) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _children_of(run), "serve left its processes running"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:       # nothing answers on the port any more
            try:
                health_status(ch)
                raise AssertionError("the worker still answers after serve stopped")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _children_of(run):
            os.kill(pid, signal.SIGKILL)
