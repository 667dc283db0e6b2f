"""Glue shared by the two process entry points: settings -> EngineConfig, CLI flags, clean exits."""

from __future__ import annotations

import argparse
import logging
import sys

from betelgeuse.config import EngineConfig, parse_slots
from betelgeuse.errors import BetelgeuseError
from betelgeuse.logs import FORMATS, LEVELS, setup as setup_logging
from betelgeuse.settings import Resolved, Settings, resolve_settings

log = logging.getLogger("betelgeuse")


def resolve_device(device: str, use_torch: bool = True) -> str:
    """'auto' -> 'cuda' or 'cpu'. The store passes use_torch=False: it must not import torch (hundreds of MB
    under the shared MemoryMax) and only needs the answer to size the VRAM tier; it looks for the driver's
    device node instead."""
    if device != "auto":
        return device
    if not use_torch:
        import os
        return "cuda" if os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != "" else "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(s: Settings, use_torch: bool = True) -> EngineConfig:
    """The engine's configuration from the settings file (both processes derive the same one)."""
    eng = getattr(s, "engine", None)
    extra = {}
    if eng is not None:
        for name in ("schedule", "routing", "sub_batch", "micro_batch", "staging_slots", "ring_slots", "kernels",
                     "decode_consolidate_every", "cuda_graphs", "prefetch",
                     "max_context", "max_running", "max_queue", "max_batched_tokens", "prefill_chunk",
                     "prefix_cache_bytes", "dtype", "worker_reserve", "read_threads",
                     "max_prompt_bytes"):
            if hasattr(eng, name):
                extra[name] = getattr(eng, name)
    return EngineConfig(
        model_path=s.model.path, device=resolve_device(s.worker.device, use_torch),
        vram_slots=s.slots.vram_per_layer, host_slots=s.slots.host_per_layer, vram_backing=s.slots.vram_backing,
        vram_budget=s.budget.vram, memory_max=s.budget.memory_max, **extra)


def listen_metrics(registry, addr: str):
    """Serve /metrics on HOST:PORT; a busy or bad address is one line naming it, not a traceback."""
    from betelgeuse.metrics import serve_metrics
    from betelgeuse.settings import split_hostport
    host, port = split_hostport(addr, "metrics")
    try:
        return serve_metrics(registry, host, port)
    except OSError as e:
        raise BetelgeuseError(f"cannot serve /metrics on {addr}: {e.strerror or e}") from None


def common_args(p: argparse.ArgumentParser):
    p.add_argument("--config", help="TOML settings file (deploy/betelgeuse.toml)")
    p.add_argument("--model", help="GGUF model (overrides [model] path)")
    p.add_argument("--store-socket", help="store control socket path (overrides [store] socket)")
    p.add_argument("--fd-socket", help="arena fd hand-off socket path (overrides [store] fd_socket)")
    p.add_argument("--metrics", help="HOST:PORT for /metrics of this process ('' = off)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--vram-slots", help="VRAM slots per layer or 'auto'")
    p.add_argument("--host-slots", help="host slots per layer or 'auto'")
    p.add_argument("--no-vram-backing", action="store_true",
                   help="VRAM experts keep no host copy: more resident capacity, disk reads after a worker restart")
    p.add_argument("--memory-max", help="bytes for both processes, e.g. 12G (default: the cgroup's)")
    p.add_argument("--vram-budget", help="bytes of VRAM, e.g. 12GiB")
    p.add_argument("--schedule", choices=["layer_major", "standard"])
    p.add_argument("--routing", choices=["exact", "resident"], help="resident: approximate (ranks >= 1 among resident experts)")
    p.add_argument("--sub-batch", type=int)
    p.add_argument("--max-context", type=int)
    p.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    log_args(p)


def log_args(p: argparse.ArgumentParser):
    p.add_argument("--log-level", choices=LEVELS, help="debug | info | warning | error (default info; "
                   "env BETELGEUSE_LOG_LEVEL; [log] level)")
    p.add_argument("--log-format", choices=FORMATS, help="text (key=value fields) | json (one object per line) "
                   "(default text; env BETELGEUSE_LOG_FORMAT; [log] format)")


def configure_logging(a=None, s: Settings | None = None) -> tuple[str, str]:
    """Logging from, in order of precedence: flags, BETELGEUSE_LOG_* environment, the [log] table, defaults."""
    import os
    level = (getattr(a, "log_level", None) or ("debug" if getattr(a, "verbose", False) else None)
             or os.environ.get("BETELGEUSE_LOG_LEVEL") or (s.log.level if s else "info"))
    fmt = getattr(a, "log_format", None) or os.environ.get("BETELGEUSE_LOG_FORMAT") or (s.log.format if s else "text")
    setup_logging(level.lower(), fmt.lower())
    return level, fmt


# flag dest -> (section, key) of the setting it overrides (`betelgeuse config show` names the flag as the source)
FLAG_KEYS = {"model": ("model", "path"), "store_socket": ("store", "socket"), "fd_socket": ("store", "fd_socket"),
             "device": ("worker", "device"), "vram_slots": ("slots", "vram_per_layer"),
             "host_slots": ("slots", "host_per_layer"), "no_vram_backing": ("slots", "vram_backing"),
             "memory_max": ("budget", "memory_max"), "vram_budget": ("budget", "vram"),
             "schedule": ("engine", "schedule"), "routing": ("engine", "routing"), "sub_batch": ("engine", "sub_batch"),
             "max_context": ("engine", "max_context"), "log_level": ("log", "level"), "log_format": ("log", "format")}


def resolve_from_args(a, require_model: bool = True) -> Resolved:
    """Defaults < --config file < BETELGEUSE_* environment < flags, each value with its source."""
    r = resolve_settings(a.config)
    for dest, (section, key) in FLAG_KEYS.items():
        v = getattr(a, dest, None)
        if v is None or v is False or v == "":
            continue
        flag = "--" + dest.replace("_", "-")
        if dest in ("vram_slots", "host_slots"):
            v = parse_slots(v)
        elif dest == "no_vram_backing":
            v = False
        r.set(section, key, v, f"flag {flag}")
    if getattr(a, "verbose", False) and not getattr(a, "log_level", None):
        r.set("log", "level", "debug", "flag --verbose")
    if require_model and not r.settings.model.path:
        raise BetelgeuseError("no model: give --model PATH or [model] path in the config file")
    return r


def settings_from_args(a) -> tuple[Settings, dict]:
    """Settings from --config, the environment and flag overrides; the dict holds EngineConfig overrides."""
    r = resolve_from_args(a)
    s = r.settings
    configure_logging(a, s)
    over = {k: v for k, v in (("schedule", a.schedule), ("routing", a.routing), ("sub_batch", a.sub_batch),
                              ("max_context", a.max_context))
            if v is not None}
    return s, over


PR_SET_PDEATHSIG = 1


def die_with_parent():
    """Started by a launcher (`betelgeuse serve`, tests) that set BETELGEUSE_PARENT_PID: get SIGTERM when it dies,
    even by SIGKILL, so no orphan keeps sockets and ports. Set here, after exec, not in a preexec_fn: forking
    through Python runs grpc's fork handlers, which abort a child of a process that has used grpc."""
    import ctypes
    import os
    import signal
    parent = os.environ.pop("BETELGEUSE_PARENT_PID", "")
    if not parent.isdigit():
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):              # the parent died before prctl took effect
        raise SystemExit(1)


def run_main(fn, argv=None) -> int:
    """Run a process main; a BetelgeuseError is one line on stderr and exit 2, never a traceback."""
    die_with_parent()
    pre = argparse.ArgumentParser(add_help=False)        # logging until the config file is read
    pre.add_argument("-v", "--verbose", action="store_true")
    pre.add_argument("--log-level")
    pre.add_argument("--log-format")
    try:
        configure_logging(pre.parse_known_args(argv)[0])
    except BetelgeuseError as e:                           # a bad flag or BETELGEUSE_LOG_* value
        print(f"betelgeuse: error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        return fn(argv) or 0
    except BetelgeuseError as e:
        print(f"betelgeuse: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
