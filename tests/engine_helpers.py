"""Shared helpers for the out-of-core engine tests: tiny models, real store/worker processes,
byte counting on the store's control channel, /proc inspection, cgroup placement, page-cache maps.

Everything here drives the real thing: processes are started with `python -m services.store_main`
/ `services.worker_main`, talk over real Unix sockets and TCP ports on 127.0.0.1, and are ended by
the PID we started them with (never by name).
"""

from __future__ import annotations

import mmap
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np

from services.launcher import Proc, free_port, python_env, spawn  # noqa: F401  (free_port, Proc: for the tests)

REPO = Path(__file__).resolve().parents[1]
ARENA_MAP_NAME = "memfd:betelgeuse-arena"   # how /proc/<pid>/maps names the store's memfd

# Engine-test geometry: 32 experts so that 5 VRAM + 15 host slots is a real partial residency
# (a 40-token prompt with top-4 routing touches ~all 32 experts of a layer); vocab and width tiny.
ENGINE_SPEC = dict(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_expert=32, n_expert_used=4,
                   n_ff_exp=64, n_vocab=320, context_length=512, router_skew=0.5, seed=11, qtype="Q8_0")
# Bigger experts (~209 KiB each at Q8_0) so "far below one expert" is a meaningful bound for the
# control-socket traffic and page-cache counts land on many whole 4 KiB pages.
WIDE_SPEC = dict(n_layer=3, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_expert=16, n_expert_used=4,
                 n_ff_exp=512, n_vocab=320, context_length=512, router_skew=0.5, seed=5, qtype="Q8_0")


def write_synth(path: Path | str, **spec) -> Path:
    """Write a seeded synth qwen3moe GGUF (the `tiny` preset with `spec` overrides) once."""
    from betelgeuse.gguf.synth import PRESETS, write_model
    path = Path(path)
    if not path.exists():
        tmp = path.with_suffix(".partial")
        write_model(tmp, replace(PRESETS["tiny"], **spec), progress=False)
        os.replace(tmp, path)
    return path


def write_ds4_tiny(path: Path | str, **spec) -> Path:
    """Write the `ds4-tiny` preset with `spec` overrides (spec_from_preset's: expert_qtype, seed, n_expert, ...)
    once."""
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    path = Path(path)
    if not path.exists():
        write_model(path, spec_from_preset("ds4-tiny", **spec), progress=False)
    return path


def write_tiny_pair(d) -> dict:
    """{"qwen3moe": the tiny engine model (ENGINE_SPEC), "deepseek4": ds4-tiny with Q8_0 experts} written into d."""
    return {"qwen3moe": write_synth(d / "engine.gguf", **ENGINE_SPEC),
            "deepseek4": write_ds4_tiny(d / "ds4.gguf", expert_qtype="Q8_0", seed=2)}


def prompt(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, n_vocab, n)]


# ---- in-process engine ---------------------------------------------------------------------------

def in_process_runner(path, vram_slots, host_slots, **cfg):
    """(runner, store): a ModelRunner over a real ExpertStore in this process (its memfd mapped twice), assembled as
    every composition root does (betelgeuse/assembly.py); 2 read threads unless cfg says otherwise."""
    from betelgeuse.assembly import open_runner, open_store
    from betelgeuse.config import EngineConfig
    c = EngineConfig(model_path=str(path), vram_slots=vram_slots, host_slots=host_slots, **{"read_threads": 2, **cfg})
    store = open_store(c)
    try:
        return open_runner(c, store), store.store
    except BaseException:
        store.close()
        raise


@contextmanager
def counted_pool_runner(monkeypatch, path):
    """A pool-routed in-process runner of a deepseek4 file (2 VRAM + 2 host slots) whose model runs TritonOps with
    its Triton launches counted, not run (memtrack.stub_triton) -> (runner, count): count(fn) runs fn and returns
    (the launches it made, on CUDA's count: torch ops and Triton kernels, {Triton kernel: launches})."""
    from betelgeuse.kernels.triton_ds4 import TritonOps
    from memtrack import KernelCount, stub_triton
    launches = stub_triton(monkeypatch)
    rn, st = in_process_runner(path, 2, 2, routing="pool")

    def count(fn) -> tuple[int, dict]:
        launches.clear()
        with KernelCount(launches) as k:
            fn()
        return k.total, dict(launches)
    try:
        rn.model.ops = TritonOps()
        yield rn, count
    finally:
        close_runner(rn, st)


def reference_logits(ref, ids: list[int], n_ctx: int = 64):
    """[T, V] float32 logits of a reference model (betelgeuse.model) prefilling `ids` into a fresh cache of `n_ctx`
    tokens: what the engine's logits are checked against."""
    import torch
    with torch.no_grad():
        return ref.forward(torch.tensor(ids), ref.new_cache(n_ctx)).float()


def qwen3_reference(path, ids: list[int], n_ctx: int = 64):
    """(the Qwen3MoeReference of the synth file at `path`, its logits of `ids` [T, V] float32: reference_logits)."""
    from betelgeuse.model.qwen3moe import Qwen3MoeReference
    ref = Qwen3MoeReference.load(path)
    return ref, reference_logits(ref, ids, n_ctx)


def synth_reference(tmp_path_factory, preset: str, prompt: list[int], n_ctx: int, chunk: int | str | None = "auto",
                    **overrides):
    """(path, reference model, its logits of `prompt` [T, V] float32) for a synth preset with `overrides`; the
    reference prefills in chunks of `chunk` (auto: the architecture's, as a runner with prefill_chunk auto)."""
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    from betelgeuse.model import reference_model
    spec = replace(spec_from_preset(preset), **overrides)
    path = tmp_path_factory.mktemp(preset) / f"{preset}-{abs(hash(tuple(sorted(overrides.items()))))}.gguf"
    write_model(path, spec, progress=False)
    ref = reference_model(path, chunk=chunk)
    return path, ref, reference_logits(ref, prompt, n_ctx)


def three_passes(path, prompt: list[int], want, vram: int, host: int, n_ctx: int, check=None, **cfg):
    """Cold, warm (consolidating) and consolidated passes of `prompt` through the in-process engine, each asserted
    bit-identical to `want`; check(runner, cache) runs once first. -> (the passes' stats, the store's status)."""
    import torch
    runner, store = in_process_runner(path, vram, host, **cfg)
    try:
        stats = []
        for name, consolidate in (("cold", False), ("warm", True), ("consolidated", False)):
            kv = runner.new_cache(n_ctx)
            if check is not None and not stats:
                check(runner, kv)
            logits, st = runner.forward(prompt, kv, all_logits=True, consolidate=consolidate)
            runner.settle()
            diff = (logits - want).abs().max().item()
            assert torch.equal(logits, want), f"{vram}/{host} {name}: max |diff| {diff:.3e}, not bit-identical"
            stats.append(st)
        return stats, store.status()
    finally:
        close_runner(runner, store)


def decode_bit_identical(model, prompt: list[int], split: int, vram: int, host: int, static: bool, n_ctx: int = 200,
                         **cfg) -> list[list]:
    """Prefill prompt[:split], then one-token passes of the rest. The reference's rows (model: synth_reference's
    (path, ref, want)) match its whole-prompt prefill `want` within 1e-4 x max|want| (decode equals prefill); the
    in-process runner's rows (static: its static decode, worker/decode_graphs.py SoloDecode, eagerly here) are the
    reference's bits, cold and after consolidation. -> each pass's decode steps' stats."""
    import torch
    path, ref, want = model
    kv = ref.new_cache(n_ctx)
    with torch.no_grad():
        ref_rows = torch.cat([ref.forward(torch.tensor(prompt[:split]), kv)] +
                             [ref.forward(torch.tensor([t]), kv) for t in prompt[split:]])
    assert (ref_rows - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    runner, store = in_process_runner(path, vram, host, **cfg)
    runner._static_decode = static
    try:
        passes = []
        for _ in range(2):                                            # cold, then after consolidation
            rkv = runner.new_cache(n_ctx)
            rows = [runner.forward(prompt[:split], rkv, all_logits=True)[0]]
            steps = [runner.forward([t], rkv, consolidate=False) for t in prompt[split:]]
            rows += [lg for lg, _ in steps]
            runner.consolidate()
            runner.settle()
            got = torch.cat(rows)
            assert torch.equal(got, ref_rows), f"max |diff| {(got - ref_rows).abs().max():.3e}"
            passes.append([st for _, st in steps])
        return passes
    finally:
        close_runner(runner, store)


def lanes_decode(path, prompts, steps, vram, host, together, stats=None):
    """Greedy decode of `prompts` through the static form's lanes (worker/lanes.py, 3 lanes, eagerly on the CPU):
    together in one batch per step, or each alone -> logits [steps, n_vocab] per prompt (stats: a list that gets
    each decode step's PassStats)."""
    import torch
    runner, store = in_process_runner(path, vram, host, max_running=3)
    runner._static_decode = True
    try:
        groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
        out = [[] for _ in prompts]
        for g in groups:
            kvs = [runner.new_cache(64) for _ in g]
            toks = [int(runner.forward(prompts[i], kv)[0][-1].argmax()) for i, kv in zip(g, kvs)]
            for _ in range(steps):
                lg, st = runner.decode_batch(toks, kvs)
                if stats is not None:
                    stats.append(st)
                for j, i in enumerate(g):
                    out[i].append(lg[j])
                toks = [int(x) for x in lg.argmax(-1)]
        return [torch.stack(o) for o in out]
    finally:
        close_runner(runner, store)


def greedy_steps(rn, toks, kvs, form: str, steps: int, before=None):
    """`steps` greedy decode steps of the sequences kvs from their next tokens toks: "rows" / "batch" one
    decode_batch of all a step, else each row alone through forward() -> (logits [steps, rows, V], every pass's
    PassStats). before(): called at each step's start (a test's log or per-step lists)."""
    import torch
    outs, stats = [], []
    for _ in range(steps):
        if before is not None:
            before()
        if form in ("rows", "batch"):
            lg, s = rn.decode_batch(toks, kvs)
            stats.append(s)
        else:
            rows = []
            for i, kv in enumerate(kvs):
                lg1, s = rn.forward([toks[i]], kv, consolidate=False)
                rows.append(lg1[-1:])
                stats.append(s)
            lg = torch.cat(rows)
        outs.append(lg)
        toks = [int(x) for x in lg.argmax(-1)]
    return torch.stack(outs), stats


def close_to_reference_decode(ref, prompts, outs):
    """Each prompt's greedy decode logits outs[i] [steps, V] (lanes_decode) equal the reference model's one-token
    passes on the same greedy path within float noise."""
    import torch
    for P, a in zip(prompts, outs):
        kv = ref.new_cache(64)
        with torch.no_grad():
            lg = ref.forward(torch.tensor(P), kv)
            rows = []
            for _ in range(a.shape[0]):
                lg = ref.forward(torch.tensor([int(lg[-1].argmax())]), kv)
                rows.append(lg[-1])
        torch.testing.assert_close(a, torch.stack(rows), rtol=1e-4, atol=1e-4 * float(a.abs().max()))


@contextmanager
def engine_and_store(cfg):
    """An in-process store + engine for `cfg` (betelgeuse.assembly, as serve opens them) -> the engine; both closed
    after."""
    from betelgeuse.assembly import open_engine, open_store
    store = open_store(cfg)
    try:
        eng = open_engine(cfg, store)
        try:
            yield eng
        finally:
            eng.close()
    finally:
        store.close()


def metered_engine(cfg):
    """(engine with worker metrics, close()): an in-process store + engine for `cfg`, closed by close()."""
    from betelgeuse.assembly import open_engine, open_store
    from betelgeuse.metrics import make_worker_metrics
    store = open_store(cfg)
    eng = open_engine(cfg, store, metrics=make_worker_metrics())

    def close():
        eng.close()
        store.close()
    return eng, close


def close_runner(runner, store):
    runner.close()
    store.close()
    store.model.close()


# ---- processes -------------------------------------------------------------------------------------

def _cgroup_preexec(cg):
    """Runs in the child between fork and exec: the process enters `cg` before it allocates anything."""
    procs = os.path.join(cg.path, "cgroup.procs")

    def enter():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    return enter


def _spawn(name: str, module: str, args: list[str], log_dir: Path, cgroup=None) -> Proc:
    log = Path(log_dir) / f"{name}-{time.monotonic_ns()}.log"
    return spawn(name, module, args, log, env=python_env(OMP_NUM_THREADS="1"), cwd=str(REPO),
                 preexec=_cgroup_preexec(cgroup) if cgroup is not None else None)


@dataclass
class StoreSockets:
    dir: Path

    @property
    def control(self) -> str:
        return str(self.dir / "store.sock")

    @property
    def fds(self) -> str:
        return str(self.dir / "store-fd.sock")

    def flags(self) -> list[str]:
        return ["--store-socket", self.control, "--fd-socket", self.fds]


def start_store(model, sockets: StoreSockets, vram="0", host="0", extra=(), cgroup=None, wait=True,
                timeout: float = 60.0) -> Proc:
    p = _spawn("store", "services.store_main",
               ["--model", str(model), *sockets.flags(), "--metrics", "", "--device", "cpu",
                "--vram-slots", str(vram), "--host-slots", str(host), *extra], sockets.dir, cgroup)
    if wait:
        wait_store(p, sockets, timeout)
    return p


def wait_store(p: Proc, sockets: StoreSockets, timeout: float = 60.0) -> dict:
    """Until the store answers Status on its control socket (it listens after the arena is pre-faulted)."""
    t0 = time.monotonic()
    while True:
        if not p.alive():
            raise AssertionError(f"store exited with {p.popen.returncode}:\n{p.log()}")
        if os.path.exists(sockets.fds):
            try:
                return store_status(sockets.control, timeout=2.0)
            except grpc.RpcError:
                pass
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"store not ready after {timeout} s:\n{p.log()}")
        time.sleep(0.1)


def start_worker(model, sockets: StoreSockets, port: int, vram="0", host="0", extra=(), cgroup=None,
                 wait=True, timeout: float = 90.0) -> Proc:
    # no HTTP unless a test asks (the default 127.0.0.1:8000 would be one port for every test process at once)
    http = () if "--http" in extra else ("--http", "")
    p = _spawn("worker", "services.worker_main",
               ["--model", str(model), *sockets.flags(), "--metrics", "", *http, "--device", "cpu",
                "--vram-slots", str(vram), "--host-slots", str(host), "--listen", f"127.0.0.1:{port}", *extra],
               sockets.dir, cgroup)
    if wait:
        wait_health(port, "SERVING", timeout, proc=p)
    return p


# ---- talking to the processes ------------------------------------------------------------------------

def store_status(control_socket: str, timeout: float = 5.0) -> dict:
    """The store's Status RPC on a fresh channel, without attaching (which would replace the worker's session)."""
    import json
    from services.pb.betelgeuse.v1 import store_pb2 as spb
    from services.pb.betelgeuse.v1 import store_pb2_grpc as spb_grpc
    with grpc.insecure_channel(f"unix:{control_socket}") as ch:
        return json.loads(spb_grpc.ExpertStoreStub(ch).Status(spb.StatusRequest(), timeout=timeout).json)


def health(port: int, timeout: float = 2.0) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            return f"RPC_{e.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def wait_health(port: int, want: str, timeout: float, proc: Proc | None = None) -> float:
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        if proc is not None and not proc.alive():
            raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()}")
        last = health(port)
        if last == want:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"health stayed {last}, wanted {want} within {timeout} s"
                         + (f":\n{proc.log()}" if proc else ""))


def generate(port: int, ids: list[int], max_tokens: int = 4, timeout: float = 60.0):
    """Greedy Generate over gRPC; returns the FinalEvent (token_ids, usage). Raises grpc.RpcError."""
    from services.pb.betelgeuse.v1 import inference_pb2 as ipb
    from services.pb.betelgeuse.v1 import inference_pb2_grpc as ipb_grpc
    req = ipb.GenerateRequest(prompt_ids=ipb.TokenIds(ids=ids), max_tokens=max_tokens, ignore_eos=True,
                              sampling=ipb.SamplingParams(temperature=0.0))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        final = None
        for r in ipb_grpc.InferenceServiceStub(ch).Generate(req, timeout=timeout):
            if r.HasField("final"):
                final = r.final
    assert final is not None, "Generate ended without a FinalEvent"
    return final


class _Empty:
    def ByteSize(self) -> int:
        return 0


class ByteCounter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamStreamClientInterceptor):
    """Counts serialized protobuf bytes both ways on a client channel (requests + every response; a stream's messages
    as grpc sends and the caller reads them)."""

    def __init__(self):
        self.sent = 0
        self.received = 0
        self.calls = 0

    @property
    def total(self) -> int:
        return self.sent + self.received

    def intercept_unary_unary(self, continuation, details, request):
        self.calls += 1
        self.sent += request.ByteSize()
        resp = continuation(details, request)
        try:
            self.received += resp.result().ByteSize()
        except grpc.RpcError:
            pass
        return resp

    def intercept_unary_stream(self, continuation, details, request):
        self.calls += 1
        self.sent += request.ByteSize()
        it = continuation(details, request)
        counter = self

        class Counted:                 # keep the call object's methods (cancel, code) available
            def __iter__(self):
                return self

            def __next__(self):
                m = next(it)
                counter.received += m.ByteSize()
                return m

            def __getattr__(self, name):
                return getattr(it, name)
        return Counted()

    def intercept_stream_stream(self, continuation, details, request_iterator):
        counter = self

        def sent():
            for r in request_iterator:
                counter.sent += r.ByteSize()
                yield r
        self.calls += 1
        return self.intercept_unary_stream(lambda d, _: continuation(d, sent()), details, _Empty())


def counting_store_client(sockets: StoreSockets, session_transport: str = "grpc"):
    """A GrpcStoreClient whose control channel counts bytes (the counter is `.counter`; with session_transport
    "seqpacket" the session stream's messages are not on the channel: not counted)."""
    from services.grpc.store_client import GrpcStoreClient

    class Counting(GrpcStoreClient):
        def attach(self):
            out = super().attach()
            self.bind(grpc.intercept_channel(self.channel, self.counter))
            return out
    c = Counting(sockets.control, sockets.fds, session_transport=session_transport)
    c.counter = ByteCounter()
    return c


# ---- /proc ------------------------------------------------------------------------------------------

def arena_mappings(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.strip() for line in f if ARENA_MAP_NAME in line]


def proc_io(pid: int) -> dict[str, int]:
    """/proc/<pid>/io: wchar counts every byte the process wrote with write/send (sockets included)."""
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


# ---- page cache ---------------------------------------------------------------------------------------

from pagecache import resident_map  # noqa: E402,F401  (one mincore reader for all tests)


def expert_page_mask(path: str) -> np.ndarray:
    """bool [n_pages]: pages lying wholly inside an expert tensor (`*_exps`), from gguf's own reader
    (independent of ours). Pages shared with a dense tensor are excluded: mmap reads of it may cache them."""
    from gguf import GGUFReader
    page = mmap.PAGESIZE
    n = -(-os.path.getsize(path) // page)
    mask = np.zeros(n, dtype=bool)
    for t in GGUFReader(path).tensors:
        if "_exps." in t.name:
            lo = -(-int(t.data_offset) // page)
            hi = (int(t.data_offset) + int(t.n_bytes)) // page
            mask[lo:hi] = True
    return mask


# ---- the Hugging Face oracle ---------------------------------------------------------------------------

def hf_model(path: Path, n_ff_exp: int):
    """transformers' own Qwen3MoE reading the same GGUF (see tests/model/test_model_oracle.py)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        moe_intermediate_size=n_ff_exp, norm_topk_prob=True).eval()


def greedy_together(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt a greedy request (`ignore_eos`, `max_tokens`) submitted to the engine at once, one thread each ->
    each request's tokens, in the prompts' order."""
    import threading
    from betelgeuse.api import FinalEvent, GenerateRequest, SamplingParams, TokenEvent
    out: dict = {}

    def one(ids, i):
        req = GenerateRequest(prompt_ids=list(ids), max_tokens=max_tokens, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.0))
        toks = []
        for ev in engine.submit(req):
            if isinstance(ev, TokenEvent):
                toks.append(ev.token_id)
            elif isinstance(ev, FinalEvent):
                out[i] = toks
    ts = [threading.Thread(target=one, args=(ids, i)) for i, ids in enumerate(prompts)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    assert len(out) == len(prompts), "a request did not finish"
    return [out[i] for i in range(len(prompts))]


def backing_workload(path, backing, vram: int, arena_slots: int, rounds: list[list[list[int]]], max_tokens: int,
                     **cfg) -> dict:
    """`vram_backing` on vs off at one memory budget, through the engine (the real scheduler and consolidation policy)
    over a store in this process. The budget is a memory limit whose arena holds `arena_slots` host slots per layer
    (plus the same staging slots and worker reserve either way); `vram` VRAM slots per layer; host slots auto.
    Each round submits its prompts together (greedy, `ignore_eos`, `max_tokens` each); the last round is measured:
    its decode passes' disk bytes (experts a pass had to read) and the store's disk bytes over the round (those plus
    consolidation fills and the round's prefill). -> {"plan", "tokens" (per prompt of the last round), "decoded",
    "decode_disk_bytes", "store_disk_bytes", "decode_disk_reads"}."""
    from betelgeuse.assembly import open_engine, open_store
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.reader import GGUFModelFile
    from betelgeuse.store.plan import HEADROOM, plan_slots
    kw = {"model_path": str(path), "vram_slots": vram, "read_threads": 2, "staging_slots": 16, "prefix_cache_bytes": 0,
          "prefix_host_bytes": 0, "max_running": max(len(r) for r in rounds), **cfg}
    f = GGUFModelFile.open(str(path))
    try:   # the budget: the arena of `arena_slots` host slots per layer, no copies, + the worker's reserve + headroom
        sized = plan_slots(f, EngineConfig(**kw, host_slots=arena_slots, vram_backing=False), None)
    finally:
        f.close()
    limit = sized.arena_bytes + sized.worker_reserve + HEADROOM
    c = EngineConfig(**kw, host_slots="auto", vram_backing=backing)
    store = open_store(c, limit)
    engine = open_engine(c, store)
    passes: list = []
    engine.on_pass = passes.append
    try:
        for r in rounds:
            passes.clear()
            before = store.store.status()["disk_bytes"]
            toks = greedy_together(engine, r, max_tokens)
        dec = [p for p in passes if p.kind == "decode"]
        p = store.store.plan
        return {"plan": p, "tokens": toks, "decoded": sum(p.n_tokens for p in dec),
                "decode_disk_bytes": sum(p.disk_bytes for p in dec), "decode_disk_reads": sum(p.reads["disk"] for p in dec),
                "store_disk_bytes": store.store.status()["disk_bytes"] - before}
    finally:
        engine.close()
        store.close()


def settles(pred, timeout: float = 10.0) -> bool:
    """Whether pred() becomes true within `timeout` s. For what the engine does after a request's final event (its
    state's release, the consolidation rule: engine._end), which a client that has returned may not see yet."""
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


class StateBytes:
    """The byte counter of DESIGN.md invariant 3 around a runner with a flex cache: wraps its model's new_cache and
    grow_cache (called once the flex cache made room), the cache's fills and the runner's release, and at each checks
    flex bytes + the live states' bytes (+ what is about to be allocated) against `budget`, the plan's KV
    reservation with the graphs'. Checks run on the engine's thread: misses are collected in `over` for the test to
    assert."""

    def __init__(self, rn):
        self.rn, self.flex, self.budget = rn, rn.flex, rn._kv_reserved()
        self.live: dict = {}                  # uid -> bytes of the states allocated and held
        self.checks = self.peak = self.grown = self.via_host = 0
        self.over: list = []
        self.most_held_running: dict = {}     # states live -> the most experts the flex cache held meanwhile
        m, f = rn.model, rn.flex
        self._new, self._grow, self._keep, self._release = m.new_cache, m.grow_cache, f.keep, rn.release
        m.new_cache, m.grow_cache, f.keep, rn.release = self._new_cache, self._grow_cache, self._keep_, self._release_

    def check(self, extra: int = 0):
        total = self.flex.nbytes + sum(self.live.values()) + extra
        self.checks += 1
        self.peak = max(self.peak, total)
        if total > self.budget:
            self.over.append((self.flex.describe(), dict(self.live), extra, self.budget))
        n = len(self.live)
        self.most_held_running[n] = max(self.most_held_running.get(n, 0), self.flex.n_held)

    def _new_cache(self, n):
        self.check(self.rn._state_bytes(n))            # the new state counted in
        kv = self._new(n)
        self.live[kv.uid] = kv.nbytes()
        self.check()
        return kv

    def _grow_cache(self, kv, n, via_host):
        old = self.live.pop(kv.uid)
        # the new state, and the one layer's tensors the copy holds twice unless it goes through the host
        self.check(self.rn._state_bytes(n) + (0 if via_host else -(-old // self.rn.mcfg.n_layer)))
        self.grown += 1
        self.via_host += via_host
        new = self._grow(kv, n, via_host)
        self.live[new.uid] = new.nbytes()
        self.check()
        return new

    def _keep_(self, *a, **k):
        self._keep(*a, **k)
        self.check()

    def _release_(self, kv):
        self.live.pop(kv.uid, None)
        self._release(kv)

    def all_released(self, timeout: float = 10.0) -> bool:
        """Whether every state was released and the flex cache holds none, waiting up to `timeout` s: a request's final
        event goes out before the runner releases its state (engine._end), so a client may return a moment before."""
        return settles(lambda: not self.live and self.flex.held == 0, timeout)


# ---- placement churn -------------------------------------------------------------------------------

# the workloads of churn_workload: name -> rounds, each round's requests submitted together as (prompt, max_tokens);
# "agent" turns grow one conversation (each turn: the last prompt, its output, then new tokens), built as it runs
CHURN_WORKLOADS = ("repeat", "batch", "agent")


def churn_model(dir_: Path, n_expert: int = 64) -> Path:
    """A 3-layer synth model with `n_expert` experts, top-8, the calibrated router (popularity and temporal locality
    fitted to real decode statistics): placement decides hits once the tiers hold a third of the experts."""
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    path = Path(dir_) / f"churn-{n_expert}.gguf"
    if not path.exists():
        write_model(path, spec_from_preset("tiny", router="calibrated", n_layer=3, n_expert=n_expert, n_expert_used=8,
                                           n_vocab=512, qtype="Q8_0"), progress=False)
    return path


def churn_workload(path, workload: str, vram: int, host: int, backing: bool = False, sequences: int = 8,
                   rounds: int = 4, tokens: int = 24, seed: int = 3, **cfg) -> dict:
    """A steady workload through the engine over a store in this process (the real scheduler, the real consolidation
    rule) -> counts of placement work: {"tokens" (per round, per request), "moves" (placement changes the store
    planned), "consolidations", "fill_reads" (consolidation fills read from disk), "demand_reads" (expert uses
    read from disk by passes), "vram_fill_disk" (VRAM fills read from disk: no backing copy), "disk_bytes" (the
    store's, all reads), and "late" the same over the rounds after the first (the steady part)}.
    repeat: one prompt, `rounds` times in turn; batch: `sequences` different prompts together, `rounds` times;
    agent: `sequences` conversations together, each turn its last prompt + output + 8 new tokens. seed: the
    prompts'. "max_new": the fill budget of the store's last consolidation (None: unbounded, engine.fill_budget off)."""
    from betelgeuse.assembly import open_engine, open_store
    from betelgeuse.config import EngineConfig
    from betelgeuse.gguf.reader import GGUFModelFile
    assert workload in CHURN_WORKLOADS, workload
    f = GGUFModelFile.open(str(path))
    n_vocab = f.config.n_vocab
    f.close()
    n_seq = 1 if workload == "repeat" else sequences
    c = EngineConfig(**{"model_path": str(path), "vram_slots": vram, "host_slots": host, "vram_backing": backing,
                        "read_threads": 2, "staging_slots": 32, "max_running": n_seq, "decode_consolidate_every": 8,
                        **cfg})
    store = open_store(c)
    engine = open_engine(c, store)
    passes: list = []
    engine.on_pass = passes.append
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(3, n_vocab, 24)] for _ in range(n_seq)]
    keys = ("moves", "consolidations", "fill_reads", "demand_reads", "vram_fill_disk", "disk_bytes")

    def counts():
        st = store.store.status()
        return {"moves": st["consolidation_moves"], "consolidations": st["consolidations"],
                "fill_reads": st["consolidation_reads"], "disk_bytes": st["disk_bytes"],
                "demand_reads": sum(p.reads["disk"] for p in passes),
                "vram_fill_disk": sum(p.fill_disk for p in passes)}

    try:
        outs, after_first = [], None
        for r in range(rounds):
            out = greedy_together(engine, prompts, tokens)
            # the round's last consolidation applied and its VRAM fills done (the engine's idle settling)
            assert settles(lambda: not engine._unsettled and not engine.running, 60), "the engine did not settle"
            outs.append(out)
            if workload == "agent":
                prompts = [p + out[i] + [int(x) for x in rng.integers(3, n_vocab, 8)] for i, p in enumerate(prompts)]
            if r == 0:
                after_first = counts()
        end = counts()
        return {"tokens": outs, **end, "late": {k: end[k] - after_first[k] for k in keys},
                "max_new": store.store.status()["consolidation_max_new"]}
    finally:
        engine.close()
        store.close()
