"""`betelgeuse` command line: a table of subcommands, one small function each.

Every BetelgeuseError (a user mistake) prints `betelgeuse: error: <message>` on stderr and exits
with its exit code (2); argparse usage errors do the same, on one line. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections import Counter
from typing import Callable

from betelgeuse.errors import BetelgeuseError, InvalidRequestError
from services.launcher import serve_arguments

PROG = "betelgeuse"


class _UsageError(BetelgeuseError):
    """A command line argparse rejected."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):                # argparse prints usage + exits; we want one line
        raise _UsageError(f"{message} (see '{self.prog} --help')")


# ----------------------------------------------------------------------------------- helpers

def parse_token_ids(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3]; InvalidRequestError naming the bad item."""
    items = [s.strip() for s in text.replace(" ", ",").split(",") if s.strip()]
    if not items:
        raise InvalidRequestError("--token-ids is empty (expected e.g. 1,2,3)")
    try:
        return [int(s) for s in items]
    except ValueError:
        bad = next(s for s in items if not s.lstrip("-").isdigit())
        raise InvalidRequestError(f"--token-ids: {bad!r} is not an integer (expected e.g. 1,2,3)") from None


def _dtype(name: str):
    import torch
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise InvalidRequestError(f"--dtype must be one of {', '.join(table)}, got {name!r}")
    return table[name]


def _load_model(args):
    from betelgeuse.model import reference_model
    return reference_model(args.model, device=args.device, dtype=_dtype(args.dtype))


@contextlib.contextmanager
def _recording(args, model):
    """--record-routing with the reference engine: the model's route() recorded into the trace file, written at the
    end (the out-of-core engine records in its runner)."""
    path = getattr(args, "engine.record_routing", None)
    if not path:
        yield
        return
    from betelgeuse.routing.trace import Recorder, TraceWriter
    c = model.cfg
    try:
        rec = Recorder(TraceWriter(path, c.n_layer, c.n_expert, c.n_expert_used, model=args.model, arch=c.arch))
    except OSError as e:
        raise InvalidRequestError(f"cannot write the routing trace {path}: {e.strerror or e}") from None
    model.route = rec.wrap(model.route)
    try:
        yield
    finally:
        rec.close()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32 | bfloat16 | float16")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ------------------------------------------------------------------------------- subcommands

# short spellings of SynthSpec fields; every scalar field is also accepted as --n-layer, --n-embd, ...
_SYNTH_ALIASES = {"n_layer": "--layers", "n_embd": "--hidden", "n_head": "--heads", "n_head_kv": "--kv-heads",
                  "n_expert": "--experts", "n_expert_used": "--experts-used", "n_ff_exp": "--ff",
                  "n_vocab": "--vocab", "context_length": "--context"}


def _synth_args(p: argparse.ArgumentParser) -> None:
    from betelgeuse.gguf.synth import PRESETS, SynthSpec
    from betelgeuse.gguf.synth_ds4 import DS4_PRESETS, DS4Spec
    from betelgeuse.gguf.synth_ds41 import DS41_PRESETS, DS41Spec
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS) + sorted(DS4_PRESETS) + sorted(DS41_PRESETS),
                   help="qwen3moe: tiny/small/bench; deepseek4: ds4-tiny/ds4-flash (V4-Flash's layer shapes); "
                        "deepseek41: ds41-tiny/ds41-flash (V4.1-Flash's layer shapes, Engram tables 64x smaller)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--router", choices=["preset", "calibrated", "uniform"], default="preset",
                   help="preset: the preset's router_skew; calibrated: popularity and temporal locality fitted to "
                        "real decode statistics (gguf/synth_router.py; sets router_skew/drift/scale itself); "
                        "uniform: no skew, no locality (the worst case for caching)")
    qwen = {f.name for f in dataclasses.fields(SynthSpec)}
    ds4 = qwen | {f.name for f in dataclasses.fields(DS4Spec)}
    for fld in (list(dataclasses.fields(SynthSpec)) + [f for f in dataclasses.fields(DS4Spec) if f.name not in qwen]
                + [f for f in dataclasses.fields(DS41Spec) if f.name not in ds4]):
        kind = {"int": int, "float": float, "str": str}.get(str(fld.type).replace("'", ""))
        if kind is None and fld.type in (int, float, str):
            kind = fld.type
        if kind is None:
            continue
        flags = ["--" + fld.name.replace("_", "-")]
        if fld.name in _SYNTH_ALIASES:
            flags.insert(0, _SYNTH_ALIASES[fld.name])
        p.add_argument(*flags, dest="spec_" + fld.name, type=kind, default=None, metavar=fld.name.upper(),
                       help=f"override the preset's {fld.name}")


def cmd_synth(args) -> int:
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    overrides = {k[5:]: v for k, v in vars(args).items() if k.startswith("spec_") and v is not None}
    spec = spec_from_preset(args.preset, router=args.router, **overrides)
    try:
        write_model(args.out, spec, progress=not args.no_progress)
    except OSError as e:
        raise InvalidRequestError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF model file")


def _header_value(value, types: tuple[int, ...]) -> str:
    """One line per metadata value: arrays longer than 8 as '[N x type: first, ...]'."""
    if isinstance(value, list):
        from betelgeuse.gguf import header as h
        names = {h.UINT8: "u8", h.INT8: "i8", h.UINT16: "u16", h.INT16: "i16", h.UINT32: "u32", h.INT32: "i32",
                 h.FLOAT32: "f32", h.BOOL: "bool", h.STRING: "string", h.ARRAY: "array", h.UINT64: "u64",
                 h.INT64: "i64", h.FLOAT64: "f64"}
        kind = names.get(types[1], "?") if len(types) > 1 else "?"
        if len(value) > 8:
            head = ", ".join(repr(v) if isinstance(v, str) else str(v) for v in value[:3])
            return f"[{len(value)} x {kind}: {head}, ...]"
        return "[" + ", ".join(repr(v) if isinstance(v, str) else str(v) for v in value) + "]"
    if isinstance(value, str):
        text = value if len(value) <= 120 else value[:117] + "..."
        return repr(text)
    return str(value)


def cmd_inspect(args) -> int:
    """The header of any GGUF file (version, metadata, tensor types), then, for a model Betelgeuse can
    serve, its geometry and expert sizes; for one it cannot, the reason (exit 0: the file is readable)."""
    from betelgeuse.errors import UnsupportedError
    from betelgeuse.gguf.header import read_header
    from betelgeuse.gguf.qtypes import SUPPORTED_QTYPES, qtype_name
    hdr = read_header(args.model)
    arch = hdr.metadata.get("general.architecture", "?")
    tensor_bytes = hdr.file_size - hdr.data_offset
    lines = [f"file:          {args.model} ({hdr.file_size / 2**30:.3f} GiB)",
             f"gguf:          version {hdr.version}, {len(hdr.tensors)} tensors, {len(hdr.metadata)} metadata keys, "
             f"alignment {hdr.alignment}, tensor data {tensor_bytes} B from offset {hdr.data_offset}"]
    counts = Counter(qtype_name(t.qtype) for t in hdr.tensors)
    lines.append("tensor types:  " + ", ".join(f"{n} x{k}" for n, k in sorted(counts.items())))
    unsupported = sorted({qtype_name(t.qtype) for t in hdr.tensors} - {qtype_name(q) for q in SUPPORTED_QTYPES})
    lines.append("metadata:")
    for key, value in hdr.metadata.items():
        lines.append(f"  {key} = {_header_value(value, hdr.value_types.get(key, ()))}")
    _write("\n".join(lines) + "\n")
    from betelgeuse.gguf import GGUFModelFile
    from betelgeuse.gguf.layouts import LAYOUTS
    try:
        f = GGUFModelFile.open(args.model)
    except UnsupportedError as e:
        why = " ".join(str(e).split())
        extra = f"; tensor types Betelgeuse does not read: {', '.join(unsupported)}" if unsupported else ""
        _write(f"servable:      no, architecture {arch!r}: {why}{extra}\n")
        return 0
    c = f.config
    lines = [
        "servable:      yes",
        f"model:         {c.name}",
        f"architecture:  {c.arch}",
        f"layers:        {c.n_layer}",
        f"hidden:        {c.n_embd}",
        f"heads:         {c.n_head} query / {c.n_head_kv} kv, head_dim {c.head_dim}",
        f"experts:       {c.n_expert} per layer, {c.n_expert_used} used per token, expert FFN {c.n_ff_exp}",
        f"vocab:         {c.n_vocab}",
        f"context:       {c.context_length}",
        f"rope theta:    {c.rope_theta:g}",
        f"rms eps:       {c.rms_eps:g}",
    ]
    counts = Counter(qtype_name(q) for q in _tensor_qtypes(f))
    lines.append("quant types:   " + ", ".join(f"{n} x{k}" for n, k in sorted(counts.items())))
    lines += _kernel_paths(f)
    total = 0
    for layer in range(c.n_layer):
        parts = f.expert_parts(layer, 0)
        nbytes = sum(p.nbytes for p in parts)
        kinds = "/".join(qtype_name(p.qtype) for p in parts)
        lines.append(f"layer {layer:3d}:     expert {nbytes} B ({kinds}), {nbytes * c.n_expert} B for {c.n_expert} experts")
        total += nbytes * c.n_expert
    lines.append(f"expert bytes:  {total} ({total / 2**30:.3f} GiB)")
    lines += LAYOUTS[c.arch].describe(f)              # the architecture's own lines (deepseek41: CSA2 roles, Engram)
    _write("\n".join(lines) + "\n")
    return 0


def _kernel_paths(f) -> list[str]:
    """Per tensor type, where it is computed: routed experts in the GPU's fused Triton kernels (in-kernel
    dequantization) or on the torch path (each expert dequantized per use, ~1 ms of host time each); the other
    tensors are dequantized once at load."""
    from betelgeuse.gguf.qtypes import qtype_name
    from betelgeuse.kernels.kinds import MMQ_QTYPES, TRITON_QTYPES
    expert = {p.qtype for layer in range(f.config.n_layer) for p in f.expert_parts(layer, 0)}
    out = [f"  experts {qtype_name(q):8s} " + ("GPU kernel (Triton, dequantized in the matmul)" if q in TRITON_QTYPES
                                               else "torch path (dequantized per expert and use: slower)")
           + ("; with --act-quant q8_1: int8 tensor cores" if q in MMQ_QTYPES else "")
           for q in sorted(expert, key=qtype_name)]
    dense = sorted({qtype_name(int(t.qtype)) for t in f.tensors.values() if "_exps." not in t.name})
    if dense:
        out.append(f"  other   {', '.join(dense)}: dequantized once at load")
    return ["kernels:"] + out


def _tensor_qtypes(f) -> list[int]:
    ts = f.tensors
    infos = ts.values() if isinstance(ts, dict) else ts
    return [int(getattr(t, "qtype")) for t in infos]


# the settings keys a CLI command that starts its own engine takes as flags (named, typed and described by
# betelgeuse/settings.py); its own --device / --dtype stand for worker.device / engine.dtype
_ENGINE_SECTIONS = ("slots", "budget", "engine")


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("out-of-core engine (the default path)")
    g.add_argument("--engine", choices=["two-process", "in-process", "reference"], default="two-process",
                   help="two-process: a real store process + this process as the worker (default); "
                        "in-process: the store's logic in this process; reference: all experts from the file")
    from betelgeuse.settings import add_flags
    add_flags(p, sections=_ENGINE_SECTIONS, exclude=("engine.dtype",), group="settings (betelgeuse/settings.py)")


def _engine_settings(args):
    """The settings of a command that starts its own engine: defaults < BETELGEUSE_* < its flags, validated
    (with the EngineConfig) before anything starts. Returns (Resolved, the flags given: "section.key" -> value)."""
    from betelgeuse.config import engine_config
    from betelgeuse.settings import flag_values, resolve_settings
    flags = flag_values(args)
    given = {f"{s}.{k}": v for (s, k), (v, _) in flags.items()}
    flags[("model", "path")] = (args.model, "argument MODEL")
    flags[("worker", "device")] = (args.device, "flag --device")
    flags[("engine", "dtype")] = (args.dtype, "flag --dtype")
    if args.dtype != "auto":
        given["engine.dtype"] = args.dtype
    r = resolve_settings(None, flags=flags)
    engine_config(r.settings, use_torch=False)          # cross-key checks (max_batched_tokens >= prefill_chunk, ...)
    return r, given


class _OutOfCore:
    """The out-of-core engine for one CLI command: a store (separate process, or in this process) and a
    ModelRunner in this process; .forward(ids) -> logits [T, n_vocab]."""

    def __init__(self, args):
        from betelgeuse.config import engine_config
        from services.assembly import open_runner, open_store
        r, _ = _engine_settings(args)
        self.cfg = engine_config(r.settings)
        self.runner = None
        self.store = open_store(self.cfg, "in-process" if args.engine == "in-process" else "process")
        try:
            self.runner = open_runner(self.cfg, self.store)
        except BaseException:
            self.close()
            raise

    def forward(self, ids):
        logits, _ = self.runner.forward(list(ids), self.runner.new_cache(len(ids)), all_logits=True)
        return logits

    def close(self):
        if self.runner is not None:
            self.runner.close()
        self.store.close()


def _logits_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--token-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--output", "-o", required=True, help="output .npy: float32 [n_tokens, n_vocab]")
    _engine_args(p)


def cmd_logits(args) -> int:
    import numpy as np
    ids = parse_token_ids(args.token_ids)
    if args.engine == "reference":
        model = _load_model(args)
        cfg = model.cfg
    else:
        from betelgeuse.gguf import GGUFModelFile
        with GGUFModelFile.open(args.model) as f:
            cfg = f.config
    bad = next((t for t in ids if not 0 <= t < cfg.n_vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is out of range [0, {cfg.n_vocab})")
    if len(ids) > cfg.context_length:
        raise InvalidRequestError(f"{len(ids)} tokens exceed the model's context of {cfg.context_length}")
    note = ""
    if args.engine == "reference":
        with _recording(args, model):
            logits = model.forward(ids, model.new_cache(len(ids)))
    else:
        engine = _OutOfCore(args)
        if engine.cfg.routing != "exact":
            note = f" (APPROXIMATE routing {engine.cfg.routing}: the experts depend on what the slots hold)"
        try:
            logits = engine.forward(ids)
        finally:
            engine.close()
    try:
        np.save(args.output, logits.cpu().numpy().astype(np.float32))
    except OSError as e:
        raise InvalidRequestError(f"cannot write {args.output}: {e.strerror or e}") from None
    print(f"wrote {args.output}: float32 {list(logits.shape)}{note}", file=sys.stderr)
    return 0


def default_model() -> str:
    """The built-in default: a tiny synthetic model, written once under ~/.cache/betelgeuse."""
    import os
    from betelgeuse.gguf.synth import PRESETS, write_model
    d = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "betelgeuse")
    path = os.path.join(d, "tiny-q8_0.gguf")
    if not os.path.exists(path):
        os.makedirs(d, exist_ok=True)
        print(f"writing the default model {path}", file=sys.stderr)
        write_model(path + ".part", PRESETS["tiny"], progress=True)
        os.replace(path + ".part", path)
    return path


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF model file (default: a built-in tiny synthetic model)")
    p.add_argument("--server", help="stream from a running server at HOST:PORT or unix:/path instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("BETELGEUSE_API_KEY"),
                   help="with --server: sent as 'authorization: Bearer KEY' (default: $BETELGEUSE_API_KEY)")
    p.add_argument("--tls-ca", help="with --server: connect with TLS, verifying the server against this PEM CA file")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto | float32 | bfloat16 | float16")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--token-ids", help="prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens")
    p.add_argument("--usage", action="store_true", help="print the final usage and timings (stderr)")
    _engine_args(p)


def _stream_grpc(address: str, args, ids) -> int:
    """Stream one Generate over gRPC; text to stdout, usage to stderr."""
    from services.grpc.client import generate_stream
    final = None
    for ev in generate_stream(address, prompt_text=args.prompt, prompt_ids=ids, max_tokens=args.max_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              stop=args.stop, ignore_eos=args.ignore_eos, api_key=getattr(args, "api_key", None),
                              tls_ca=getattr(args, "tls_ca", None)):
        if ev.WhichOneof("event") == "token":
            _write(ev.token.text)
        else:
            final = ev.final
    _write(final.tail + "\n")
    if args.usage:
        u = final.usage
        print(f"prompt {u.prompt_n} tok in {u.prompt_ms:.0f} ms ({u.prompt_per_second:.1f} tok/s), "
              f"generated {u.predicted_n} tok ({u.predicted_per_second:.1f} tok/s), TTFT {u.ttft_ms:.0f} ms, "
              f"expert reads vram/host/disk {u.expert_reads_vram}/{u.expert_reads_host}/{u.expert_reads_disk}, "
              f"disk {u.disk_bytes / 2**20:.1f} MiB, disk wait {u.disk_wait_ms:.0f} ms"
              + (f", Engram rows {u.engram_rows} ({u.engram_disk_bytes / 2**20:.2f} MiB from disk, wait "
                 f"{u.engram_wait_ms:.0f} ms)" if u.engram_rows else "")
              + (f", routing {u.routing} (APPROXIMATE)" if u.routing not in ("", "exact") else ""), file=sys.stderr)
    return 0


# generate's own flags that configure an engine it starts itself (besides the settings flags); with --server (an
# engine that is already running, with its own configuration) each is refused rather than silently ignored
_ENGINE_DESTS = {"model": "MODEL", "device": "--device", "dtype": "--dtype", "engine": "--engine"}


def _generate_defaults() -> dict:
    p = _Parser(prog=f"{PROG} generate")
    _generate_args(p)
    return vars(p.parse_args([]))


def cmd_generate(args) -> int:
    ids = parse_token_ids(args.token_ids) if args.token_ids is not None else None
    if args.server:
        # a thin client: no torch, no model; the server validates the request (INVALID_ARGUMENT)
        defaults = _generate_defaults()
        from betelgeuse.settings import flag_values
        given = [flag for dest, flag in _ENGINE_DESTS.items() if getattr(args, dest) != defaults[dest]]
        given += [label.removeprefix("flag ") for _, label in flag_values(args).values()]
        if given:
            raise InvalidRequestError(f"{', '.join(given)}: not with --server (the server runs with its own "
                                      f"configuration); drop {'them' if len(given) > 1 else 'it'}")
        if ids is None and args.prompt is None:
            raise InvalidRequestError("give --prompt TEXT or --token-ids 1,2,3")
        if args.max_tokens < 1:
            raise InvalidRequestError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        return _stream_grpc(args.server, args, ids)
    if args.tls_ca:
        raise InvalidRequestError("--tls-ca: only with --server (the processes generate starts itself listen on "
                                  "loopback without TLS)")
    from betelgeuse.api import SamplingParams
    from betelgeuse.sampling import validate
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    validate(sampling)                                  # before the (slow) model load
    if ids is None and args.prompt is None:
        raise InvalidRequestError("give --prompt TEXT or --token-ids 1,2,3")
    if args.max_tokens < 1:
        raise InvalidRequestError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if ids is not None and any(t < 0 for t in ids):
        raise InvalidRequestError(f"token id {min(ids)} is out of range (ids are >= 0)")
    args.model = args.model or default_model()
    if args.engine == "reference":
        return _generate_reference(args, sampling, ids)
    import tempfile
    from services.launcher import Cluster
    _, given = _engine_settings(args)                  # a bad value is refused before anything starts
    with tempfile.TemporaryDirectory(prefix="betelgeuse-") as tmp:
        cluster = Cluster(args.model, tmp, device=args.device, settings=given, worker_metrics="", store_metrics="")
        try:
            cluster.start_store()
            cluster.start_worker()
            return _stream_grpc(cluster.address, args, ids)
        finally:
            cluster.stop()


def _generate_reference(args, sampling, ids) -> int:
    from betelgeuse.model.generate import generate
    from betelgeuse.tokenizer import Tokenizer
    if args.dtype == "auto":
        args.dtype = "float32"
    model = _load_model(args)
    tok = Tokenizer.from_metadata(model.file.metadata)
    if ids is None:
        ids = tok.encode(args.prompt)
    stop_ids = [] if args.ignore_eos else list(tok.eos_ids)
    gen = generate(model, ids, args.max_tokens, sampling, stop_ids, args.stop, tok)
    with _recording(args, model):
        for _ in gen:
            _write(gen.new_text)
    _write(gen.tail + "\n")
    return 0


def serve_cluster(args, model: str, runtime_dir: str):
    """serve's Cluster and the settings both children will resolve: defaults < --config < BETELGEUSE_* < serve's
    flags, validated here (with the EngineConfig) before anything starts; the children get --config and the
    flags (their environment is ours), plus what serve owns (sockets, addresses)."""
    from betelgeuse.config import engine_config
    from betelgeuse.settings import flag_values, resolve_settings
    from services.launcher import Cluster
    flags = flag_values(args)
    r = resolve_settings(args.config, flags=flags)
    given = {f"{s}.{k}": v for (s, k), (v, _) in flags.items()}
    for key, port in (("worker.metrics", 9464), ("store.metrics", 9465)):
        section, name = key.split(".")
        if r.sources[(section, name)] == "default":           # beside the API by default
            given[key] = f"{args.host}:{port}"
    cluster = Cluster(model, runtime_dir, device=r.settings.worker.device, config=args.config, settings=given,
                      port=args.port, host=args.host, http=r.settings.worker.http,
                      worker_metrics=given.get("worker.metrics", r.settings.worker.metrics),
                      store_metrics=given.get("store.metrics", r.settings.store.metrics))
    flags.update({k: (v, "serve") for k, v in cluster.child_settings().items()})
    r = resolve_settings(args.config, flags=flags)
    engine_config(r.settings, use_torch=False)                  # cross-key checks
    return cluster, r


def cmd_serve(args) -> int:
    """Both processes for a development run, supervised until SIGTERM (exit 0) or Ctrl-C (exit 130).

    A child that crashes is restarted and named (a worker killed by a signal while starting too); SIGHUP is
    ignored; the worker is stopped first (it drains), then the store;
    further signals during the shutdown do not interrupt it, and the children die with this process
    (PR_SET_PDEATHSIG) even if it is killed with SIGKILL. If start-up fails or the supervision gives up, the
    runtime directory with both logs is kept and named."""
    import shutil
    import signal
    import tempfile
    import threading

    from services.launcher import describe_exit
    from services.signals import stop_on_signals
    model = args.model or default_model()
    tmp = None if args.runtime_dir else tempfile.mkdtemp(prefix="betelgeuse-")
    try:
        cluster, _ = serve_cluster(args, model, args.runtime_dir or tmp)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    wm, sm = cluster.worker_metrics, cluster.store_metrics
    stop = threading.Event()
    # no exception, and no lock taken in a handler: the shutdown below must not be interrupted (services/signals.py)
    sig = stop_on_signals(stop)
    got = sig.got

    def say(msg: str):
        try:
            print(msg, file=sys.stderr, flush=True)
        except OSError:                           # stderr gone (its terminal closed): keep serving, quietly
            pass
    def _on_hup(_signum, _frame):                # os.write: no buffered stream to re-enter from a signal handler
        try:
            os.write(2, b"betelgeuse: SIGHUP ignored (SIGTERM or Ctrl-C stops serve)\n")
        except OSError:
            pass
    # SIGHUP (the terminal closing, `kill -HUP`) never stops serve: the children (in their own sessions) go on
    signal.signal(signal.SIGHUP, _on_hup)
    clean = False
    try:
        try:
            cluster.start_store()
            if not stop.is_set():
                cluster.start_worker(abort=stop.is_set)
        except KeyboardInterrupt:                # a signal while starting
            pass
        except BetelgeuseError:
            # a worker killed by a signal while starting (an operator's kill, the OOM killer) is restarted by the
            # supervision below, like one killed later; one that exited on its own (a bad configuration, a model
            # it cannot load) ends serve with its message
            w = cluster.worker
            if w is None or w.popen.returncode is None or w.popen.returncode >= 0 or not cluster.store.alive():
                raise
            say(f"betelgeuse: the worker (pid {w.pid}) {describe_exit(w.popen.returncode)} while starting")
        if not stop.is_set():
            say(f"serving {model}\n  gRPC     {cluster.listen}  (betelgeuse.v1.InferenceService, health, reflection)\n"
                f"  metrics  http://{wm}/metrics (worker), http://{sm}/metrics (store)\n"
                + (f"  HTTP     {cluster.http_url}/v1  (OpenAI-compatible; try: betelgeuse chat --url {cluster.http_url})\n"
                   if cluster.http_url else "") +
                f"  logs     {cluster.runtime_dir}/worker.log, store.log\n"
                f"try: betelgeuse generate --server {cluster.address} --prompt 'Hello'   (Ctrl-C stops)")
            cluster.supervise(stop, say=say)
        clean = True
    finally:
        try:
            if got:
                say(f"betelgeuse: {signal.Signals(got[0]).name}: stopping the worker (draining), then the store")
            cluster.stop()
            if tmp is not None and clean:
                shutil.rmtree(tmp, ignore_errors=True)
            elif not clean:
                say(f"{PROG}: logs kept in {cluster.runtime_dir} (store.log, worker.log)")
        finally:
            # done (or failed): a signal from here on is ignored. The interpreter's finalization puts SIG_DFL back for
            # Python-level handlers (not for SIG_IGN), so a SIGTERM landing then turned an exit into death by SIGTERM
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            sig.close()
    return 130 if got and got[0] == signal.SIGINT else 0


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF model file (default: a built-in tiny synthetic model)")
    p.add_argument("--prompt", default="The expert store reads only what a token needs, so")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")


def cmd_demo(args) -> int:
    """The README's main command: start both processes on the default model, stream over gRPC, stop."""
    if not args.model:
        print("note: the built-in demo model has random weights (a seeded synthetic qwen3moe), so its text is "
              "gibberish; the point is the machinery. For real text pass a GGUF file (README: 'Models').",
              file=sys.stderr)
    ns = build_parser().parse_args(["generate", *( [args.model] if args.model else []), "--prompt", args.prompt,
                                    "--max-tokens", str(args.max_tokens), "--device", args.device, "--usage",
                                    "--ignore-eos"])
    return cmd_generate(ns)


# `betelgeuse store ...` / `betelgeuse worker ...`: the two process mains with their own flags (the
# container entry points, and what systemd's ExecStart= runs as `python -m services.*_main`)
PROCESS_MAINS = {"store": "services.store_main", "worker": "services.worker_main"}


def _process_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs=argparse.REMAINDER, help="the process's own flags (see its --help)")


def _run_process(name: str, argv: list[str]) -> int:
    import importlib
    from services.common import run_main
    return run_main(importlib.import_module(PROCESS_MAINS[name]).main, argv)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print the effective configuration as TOML, each value "
                   "commented with its source (default, the file, env BETELGEUSE_*, a flag)")
    from services.common import common_args
    common_args(p)                       # the same flags the store and worker processes take


def cmd_config(args) -> int:
    from betelgeuse.settings import render_toml
    from services.common import resolve_from_args
    _write(render_toml(resolve_from_args(args, require_model=False)))
    return 0


def _chat_args(p: argparse.ArgumentParser) -> None:
    from betelgeuse.chat import DEFAULT_MAX_TOKENS
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the OpenAI-compatible API (betelgeuse serve's HTTP)")
    p.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("BETELGEUSE_API_KEY"),
                   help="sent as Authorization: Bearer (default: $BETELGEUSE_API_KEY)")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, help="seed of the sampling (reproducible answers)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"per answer (default {DEFAULT_MAX_TOKENS}, or half the model's context when smaller; 0: "
                   "until EOS or the context)")
    p.add_argument("--no-thinking", action="store_true", help="chat_template_kwargs enable_thinking=false (Qwen3)")


def cmd_chat(args) -> int:
    """An interactive chat over the HTTP API (betelgeuse/chat.py): line editing and history on a terminal, slash
    commands handled here (/help), Ctrl-C stops an answer, Ctrl-D or /exit leaves."""
    from betelgeuse.chat import ChatClient, ChatSession, default_max_tokens, line_editing
    client = ChatClient(args.url, args.model, api_key=args.api_key)
    if args.max_tokens is None:
        args.max_tokens = default_max_tokens(client.context)
    tty = sys.stdin.isatty()
    session = ChatSession(client, system=args.system, thinking=False if args.no_thinking else None,
                          params={"temperature": args.temperature, "seed": args.seed,
                                  "max_tokens": args.max_tokens or None})
    save = line_editing() if tty else (lambda: None)
    if tty:
        print(f"chatting with {client.model} at {args.url}  (/help for commands, Ctrl-C stops an answer, "
              "Ctrl-D leaves)", file=sys.stderr)
    try:
        return session.run(input, "> " if tty else "")
    finally:
        save()


def _convert_args(p: argparse.ArgumentParser) -> None:
    from betelgeuse.gguf.convert_ds41 import OUTTYPES
    p.add_argument("checkpoint", help="directory of a DeepSeek-V4.1 checkpoint in the Hugging Face layout "
                                      "(config.json, *.safetensors, tokenizer.json)")
    p.add_argument("out", help="output .gguf path (llama.cpp's deepseek41 layout)")
    p.add_argument("--outtype", choices=sorted(OUTTYPES), default="q8_0",
                   help="type of the FP8 matrices and the Engram tables: q8_0 (llama.cpp's converter), bf16 or f32 "
                        "(exact); routed experts are always MXFP4 (the FP4 checkpoint's bits)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_convert(args) -> int:
    from betelgeuse.gguf.convert_ds41 import convert
    try:
        convert(args.checkpoint, args.out, args.outtype, progress=not args.no_progress)
    except OSError as e:
        raise InvalidRequestError(f"cannot convert {args.checkpoint} to {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


# name -> (help, add arguments, run); the lead adds serve / bench here
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "synth": ("write a seeded random-weight qwen3moe, deepseek4 or deepseek41 GGUF", _synth_args, cmd_synth),
    "inspect": ("print a GGUF model's geometry, quant types and expert sizes", _inspect_args, cmd_inspect),
    "convert": ("convert a DeepSeek-V4.1 checkpoint (Hugging Face layout) to a deepseek41 GGUF", _convert_args,
                cmd_convert),
    "logits": ("write the logits of a token sequence to .npy", _logits_args, cmd_logits),
    "generate": ("generate text: starts both processes (or --server ADDR) and streams over gRPC", _generate_args,
                 cmd_generate),
    "serve": ("run the expert store and the worker for a development run", serve_arguments, cmd_serve),
    "demo": ("start both processes on a built-in random-weight model and stream one generation", _demo_args,
             cmd_demo),
    "config": ("print the effective configuration (file, BETELGEUSE_* environment, flags) and each value's source",
               _config_args, cmd_config),
    "store": ("run the expert store process (container / unit entry point)", _process_args,
              lambda a: _run_process("store", a.args)),
    "worker": ("run the GPU worker process (container / unit entry point)", _process_args,
               lambda a: _run_process("worker", a.args)),
    "chat": ("chat interactively over the OpenAI-compatible HTTP API (betelgeuse serve)", _chat_args, cmd_chat),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Out-of-core Mixture-of-Experts inference from GGUF files")
    from betelgeuse import __version__
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        add_args(p)
        p.set_defaults(run=run)
    from services.bench import cli as bench_cli       # `betelgeuse bench`: its own module (many flags)
    bench_cli.add_parser(sub).set_defaults(run=bench_cli.run)
    from services import routing_cli                  # `betelgeuse routing`: statistics, trace conversion
    routing_cli.add_parser(sub).set_defaults(run=routing_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PROCESS_MAINS:                       # their flags are theirs, --help included
        return _run_process(argv[0], argv[1:])
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except BetelgeuseError as e:
        msg = " ".join(str(e).split()) or type(e).__name__     # one line, always
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:                                     # --help / --version
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:                                     # `betelgeuse generate ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
