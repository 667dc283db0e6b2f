"""Shared pieces of the service end-to-end tests: a tiny model, a real two-process cluster with its
/metrics on known loopback ports, a /metrics scraper (prometheus_client's own text parser), gRPC
stubs, and the in-process reference generation the server's tokens are checked against.

    from service_helpers import service_model, start_cluster, scrape, reference_greedy
    c = start_cluster(model, tmp_dir)                      # store + worker up, health SERVING
    before = scrape(c.worker_metrics_url)
    ...; after = scrape(c.worker_metrics_url)
    delta(before, after, "betelgeuse_expert_reads_total", tier="disk")

Nothing here is a mock: every helper talks to real processes, sockets and files.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.launcher import Cluster, free_port  # noqa: E402
from services.pb.betelgeuse.v1 import inference_pb2 as pb  # noqa: E402
from services.pb.betelgeuse.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

SERVICE = "betelgeuse.v1.InferenceService"
Samples = dict[tuple[str, frozenset], float]     # (sample name, {(label, value)}) -> value


# ---- the model ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def channel(cluster):
    """A channel to the module's `cluster` (each test module defines that fixture)."""
    with grpc.insecure_channel(cluster.address) as ch:
        yield ch


@pytest.fixture(scope="session")
def service_model(tmp_path_factory) -> Path:
    """PRESETS["tiny"] (4 layers, 16 experts, top-4, vocab 1024, context 2048), written once per session."""
    from betelgeuse.gguf.synth import PRESETS, write_model
    path = tmp_path_factory.getbasetemp() / "service-tiny.gguf"
    if not path.exists():
        write_model(path, PRESETS["tiny"], progress=False)
    return path


# ---- processes ---------------------------------------------------------------------------------------------------

# The service tests' slots: a partial residency (5 VRAM + 11 host of the tiny model's 16 experts), so requests
# read experts from every tier; the defaults (auto: every tiny expert resident) are tested in test_slot_defaults.py.
TEST_SLOTS = {"slots.vram_per_layer": 5, "slots.host_per_layer": 15}


def start_cluster(model: Path, runtime_dir: Path, config: Path | None = None, slots: dict | None = TEST_SLOTS,
                  **kw) -> Cluster:
    """Store then worker (real `python -m services.*_main` processes), /metrics on free loopback ports; `slots`
    (flags, over the config file) default TEST_SLOTS, None: the configuration's own."""
    wport, sport = free_port(), free_port()
    kw["settings"] = {**(slots or {}), **kw.get("settings", {})}
    c = Cluster(str(model), str(runtime_dir), device="cpu", config=str(config) if config else None,
                worker_metrics=f"127.0.0.1:{wport}", store_metrics=f"127.0.0.1:{sport}", **kw)
    c.worker_metrics_url = f"http://127.0.0.1:{wport}/metrics"
    c.store_metrics_url = f"http://127.0.0.1:{sport}/metrics"
    try:
        c.start_store()
        c.start_worker()
    except BaseException:
        c.stop()
        raise
    return c


def cluster_logs(c: Cluster) -> str:
    return "\n".join(f"--- {p.name} log ---\n{p.log()[-3000:]}" for p in (c.store, c.worker) if p is not None)


def bench_cli(suite: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m services.bench.cli --suite SUITE ARGS` run from this checkout (PYTHONPATH: its root), the output
    captured as text; `timeout` seconds at most (subprocess.TimeoutExpired past it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "services.bench.cli", "--suite", suite, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def print_logs(folder: Path, names=("store.log", "worker.log"), tail: int = 3000) -> None:
    """After a failure: the end of each process log in `folder` (pytest shows it with the failure)."""
    for name in names:
        if (Path(folder) / name).exists():
            print(f"--- {name} ---\n{(Path(folder) / name).read_text()[-tail:]}")


def write_toml(path: Path, sections: dict[str, dict]) -> Path:
    """A small TOML writer (str, int, bool, list of str): enough for betelgeuse.toml test configs."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return str(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        raise TypeError(type(v))
    lines = []
    for name, kv in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {val(v)}" for k, v in kv.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


# ---- /metrics ----------------------------------------------------------------------------------------------------

def scrape(url: str) -> Samples:
    """Every sample of a /metrics page, parsed by prometheus_client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels) -> float:
    """Sum of every sample `name` whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def delta(before: Samples, after: Samples, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def wait_metric(url: str, pred, timeout: float = 10.0) -> Samples:
    """Scrape until pred(samples) holds (counters are bumped just after the final event is sent)."""
    t0 = time.monotonic()
    while True:
        s = scrape(url)
        if pred(s) or time.monotonic() - t0 > timeout:
            return s
        time.sleep(0.1)


# ---- gRPC --------------------------------------------------------------------------------------------------------

def stub(channel) -> pb_grpc.InferenceServiceStub:
    return pb_grpc.InferenceServiceStub(channel)


def health_status(channel, service: str = "") -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_health(channel, want: int, timeout: float = 60.0) -> int:
    t0 = time.monotonic()
    st = None
    while time.monotonic() - t0 < timeout:
        try:
            st = health_status(channel)
        except grpc.RpcError:
            st = None
        if st == want:
            return st
        time.sleep(0.1)
    return st


def request(*, text=None, ids=None, messages=None, max_tokens=16, temperature=0.0, top_p=None, top_k=0,
            seed=None, ignore_eos=False, stop=(), cache_salt="") -> pb.GenerateRequest:
    s = pb.SamplingParams(temperature=temperature, top_k=top_k)
    if top_p is not None:
        s.top_p = top_p
    if seed is not None:
        s.seed = seed
    r = pb.GenerateRequest(sampling=s, ignore_eos=ignore_eos, stop=list(stop), cache_salt=cache_salt)
    if max_tokens is not None:
        r.max_tokens = max_tokens
    if text is not None:
        r.prompt_text = text
    elif ids is not None:
        r.prompt_ids.ids.extend(ids)
    elif messages is not None:
        r.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    return r


@dataclass(slots=True)
class Streamed:
    tokens: list[int] = field(default_factory=list)      # token ids of the TokenEvents, in order
    texts: list[str] = field(default_factory=list)
    final: object = None                                 # pb.FinalEvent, or None when the call failed
    code: grpc.StatusCode | None = None                  # None = OK
    details: str = ""


def run_stream(call, on_token=None) -> Streamed:
    """Drain a Generate call; on_token(streamed) after each token (it may cancel the call)."""
    out = Streamed()
    try:
        for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "token":
                assert ev.token.index == len(out.tokens), (ev.token.index, len(out.tokens))
                out.tokens.append(ev.token.token_id)
                out.texts.append(ev.token.text)
                if on_token:
                    on_token(out)
            else:
                assert out.final is None, "two final events"
                out.final = ev.final
    except grpc.RpcError as e:
        out.code, out.details = e.code(), e.details()
    return out


# ---- the in-process reference ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def _reference(model_path: str):
    import torch
    from betelgeuse.model.qwen3moe import Qwen3MoeReference
    from betelgeuse.tokenizer import Tokenizer
    model = Qwen3MoeReference.load(model_path, device="cpu", dtype=torch.float32)
    return model, Tokenizer.from_metadata(model.file.metadata)


def reference_tokenizer(model_path):
    return _reference(str(model_path))[1]


def reference_greedy(model_path, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False):
    """What `betelgeuse generate --engine reference` produces: (token ids, finish_reason, text)."""
    from betelgeuse.model.generate import generate
    model, tok = _reference(str(model_path))
    gen = generate(model, prompt_ids, max_tokens, None, [] if ignore_eos else sorted(tok.eos_ids), (), tok)
    ids = list(gen)
    return ids, gen.finish_reason, gen.text + gen.tail


def gguf_metadata(model_path) -> dict:
    """Key -> value straight from the file with gguf's own reader (independent of betelgeuse.gguf)."""
    import gguf
    r = gguf.GGUFReader(str(model_path))
    out = {}
    for k, f in r.fields.items():
        if not f.types:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            out[k] = len(f.data)
        elif f.types[0] == gguf.GGUFValueType.STRING:
            out[k] = bytes(f.parts[f.data[0]]).decode()
        else:
            out[k] = f.parts[f.data[0]].tolist()[0]
    out["__tensors__"] = {t.name: (int(t.n_bytes), t.tensor_type.name) for t in r.tensors}
    return out

