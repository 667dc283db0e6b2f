"""What both bench suites (`--suite passes`: cli.py, harness.py; `--suite agents`: agents.py) share: reading
their arguments (with each suite's --quick defaults), the engine's keys as flags and the EngineConfig they give,
the model and results folder they target, the model written or reused, and the OutOfTime signal that abandons a
case when the time budget runs out.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from pathlib import Path

from betelgeuse.errors import BetelgeuseError, InvalidRequestError
from betelgeuse.store.reader import drop_page_cache


class OutOfTime(Exception):
    """Raised from a case's should_stop: the pass is abandoned (KV uncommitted, no consolidation)."""


def opt_reader(quick: dict):
    """opt(args, name, default): the flag's value, else (with --quick) quick[name], else default."""
    def opt(args, name, default):
        v = getattr(args, name, None)
        if v is None and args.quick:
            v = quick.get(name)
        return default if v is None else v
    return opt


# the engine's keys, flags of every suite (named, typed and described by betelgeuse/settings.py); --slots (a list of
# V+H configurations, a case each) stands for slots.vram_per_layer / host_per_layer; engine.record_routing is not a
# bench key: every case opens its own runner (one trace file would hold only the last), and the passes suite records
# what each case routed itself (bench.json's "routing"); --routing-trace replays a trace
ENGINE_SECTIONS = ("slots", "budget", "engine")
SLOT_KEYS = ("slots.vram_per_layer", "slots.host_per_layer")
NOT_BENCH_KEYS = SLOT_KEYS + ("engine.record_routing",)
BENCH_DEFAULTS = {"budget.memory_max": "12G"}      # the deployment's budget, as the bench's cgroup


def add_engine_flags(p) -> None:
    from betelgeuse.settings import add_flags
    add_flags(p, sections=ENGINE_SECTIONS, exclude=NOT_BENCH_KEYS, defaults=BENCH_DEFAULTS,
              group="engine settings (betelgeuse/settings.py; --memory-max none or auto: no cgroup of the bench's; the "
                    "passes suite defaults to --max-running 2 --prefix-cache-bytes 0)")


def engine_from_args(args, quick: dict, model: str, device: str, suite: dict | None = None):
    """The suite's EngineConfig for `model` on `device` (a case replaces the slots and its own keys): the model's
    defaults < the bench's (BENCH_DEFAULTS, then the suite's `suite`, then with --quick the "section.key" entries of
    `quick`) < BETELGEUSE_* < the flags. `--memory-max none` is the bench's spelling of auto: no cgroup of its own,
    the store plans against the cgroup it runs in."""
    from betelgeuse.config import EngineConfig, engine_kwargs
    from betelgeuse.settings import flag_values, resolve_settings
    defaults = {**BENCH_DEFAULTS, **(suite or {}), **({k: v for k, v in quick.items() if "." in k} if args.quick else {})}
    flags = flag_values(args)
    mm = flags.get(("budget", "memory_max"))
    if mm is not None and str(mm[0]).lower() == "none":
        flags[("budget", "memory_max")] = ("auto", mm[1])
    r = resolve_settings(None, flags=flags,
                         defaults={tuple(k.split(".", 1)): (v, "bench default") for k, v in defaults.items()})
    if r.settings.engine.record_routing:
        raise InvalidRequestError(f"engine.record_routing ({r.sources[('engine', 'record_routing')]}): the bench does "
                                  "not write traces (the passes suite reports each case's routing in bench.json; "
                                  "--routing-trace replays a trace); unset it")
    return EngineConfig(**{**engine_kwargs(r.settings), "model_path": model, "device": device})


def options_record(o) -> dict:
    """A suite's options as bench.json records them: every field but the start time, the engine's keys flat."""
    import dataclasses
    out = {k: getattr(o, k) for k in o.__slots__ if k not in ("t0", "engine")}
    out.update({k: v for k, v in dataclasses.asdict(o.engine).items() if k not in ("model_path", "device")})
    return out


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not v or min(v) < 1:
        raise InvalidRequestError(f"{flag}: expected positive integers, got {text!r}")
    return v


def parse_slots(text: str) -> tuple[str, ...]:
    out = []
    for s in (x.strip() for x in text.split(",") if x.strip()):
        v, plus, h = s.partition("+")
        if s != "auto" and not (plus and v.isdigit() and h.isdigit()):
            raise InvalidRequestError(f"--slots: {s!r} is neither 'V+H' (e.g. 5+15) nor 'auto'")
        out.append(s)
    if not out:
        raise InvalidRequestError("--slots is empty")
    return tuple(out)


def ensure_model(path: Path, spec, log) -> dict:
    """Reuse `path` if it exists, else write `spec` there (fsync'd, then dropped from the page cache so
    the run starts cold and writeback does not compete with the reads). Returns facts for the results."""
    from betelgeuse.gguf.synth import model_nbytes, write_model
    if path.exists():
        return {"path": str(path), "reused": True, "bytes": path.stat().st_size, "router": router_label(spec)}
    need = model_nbytes(spec)
    free = shutil.disk_usage(path.parent).free
    if need + (1 << 30) > free:
        raise BetelgeuseError(f"not enough disk for {path}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    log(f"writing {path} ({need / 1e9:.1f} GB, router {router_label(spec)}) ...")
    t = time.perf_counter()
    try:
        import tqdm
        progress = sys.stderr.isatty() and bool(tqdm.__version__)
    except ImportError:                      # gguf's own dependency, but not on every device
        progress = False
    write_model(path, spec, progress=progress)
    drop_page_cache(str(path))
    dt = time.perf_counter() - t
    size = path.stat().st_size
    log(f"wrote {path} in {dt:.1f} s ({size / dt / 1e9:.2f} GB/s incl. fsync)")
    return {"path": str(path), "reused": False, "bytes": size, "write_s": dt, "write_GBps": size / dt / 1e9,
            "router": router_label(spec)}


def target(args, opt, suffix: str):
    """What every suite resolves from its arguments: (device, work dir, preset, model spec, model path, run name,
    results folder). opt(args, name, default) reads an option with the suite's --quick defaults; suffix names the
    suite in the default run name ("<date><suffix>-<device>")."""
    from betelgeuse.gguf.synth import spec_from_preset
    from betelgeuse.config import resolve_device
    device = resolve_device(opt(args, "device", "auto"))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    preset = opt(args, "preset", "bench")
    router = getattr(args, "router", None) or "preset"
    qtype = getattr(args, "qtype", None)
    spec = spec_from_preset(preset, router=router, n_layer=opt(args, "layers", None), router_skew=args.router_skew,
                            seed=args.seed, qtype=qtype)
    name = f"{preset}-L{spec.n_layer}-{router_label(spec)}-seed{spec.seed}{'-' + qtype if qtype else ''}.gguf"
    model = Path(args.model) if args.model else work / name
    run_name = args.run_name or time.strftime("%Y%m%d-%H%M%S") + f"{suffix}-{device.split(':')[0]}"
    out = Path(args.out) if args.out else Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / run_name
    return device, work, preset, spec, model, run_name, out


def router_label(spec) -> str:
    """How a bench model's router is named in its file name: calibrated, or skew<s> (skew0: uniform)."""
    return "calibrated" if spec.router_target else f"skew{spec.router_skew:g}"


def variant_specs(text: str, preset: str, layers: int, seed: int, qtype: str | None = None) -> list:
    """--variant-skew: comma-separated routers of the smaller comparison models (a skew, `uniform`, `calibrated`;
    `none`: no variant) -> [(label, spec)], each in the main model's --qtype."""
    from betelgeuse.gguf.synth import spec_from_preset
    out = []
    for item in (x.strip() for x in str(text).split(",") if x.strip()):
        if item.lower() == "none":
            continue
        if item in ("uniform", "calibrated"):
            spec = spec_from_preset(preset, router=item, n_layer=layers, seed=seed, qtype=qtype)
        else:
            try:
                skew = float(item)
            except ValueError:
                raise InvalidRequestError(f"--variant-skew: {item!r} is neither a skew, 'uniform', 'calibrated' nor "
                                          "'none'") from None
            spec = spec_from_preset(preset, n_layer=layers, router_skew=skew, seed=seed, qtype=qtype)
        out.append((router_label(spec), spec))
    return out


def bench_argv(args) -> list[str]:
    """The bench's own arguments, for the exact command in the results."""
    argv = getattr(args, "argv", None)
    if argv is None:
        argv = sys.argv[1:]
        argv = argv[1:] if argv[:1] == ["bench"] else argv       # run from `betelgeuse bench ...`
    return list(argv)


def suite_log(name: str, t0: float):
    """log(msg): one stderr line "[bench NAME  12.3s] msg", seconds since t0."""
    def log(msg):
        print(f"[bench {name} {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return log


def suite_results(args, suite: str, run_name: str, device: str) -> dict:
    """A suite's results as they start: the run, the exact command, the machine; cases, skipped and errors empty."""
    from services.bench.report import machine_info
    return {"suite": suite, "run": run_name, "status": "running",
            "command": shlex.join(["betelgeuse", "bench"] + bench_argv(args)), "device": device,
            "machine": machine_info(), "models": {}, "cases": [], "skipped": [], "errors": []}
