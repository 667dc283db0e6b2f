"""The one configuration file, read by both processes (deploy/betelgeuse.toml,
installed as /etc/betelgeuse/betelgeuse.toml). Defaults here match that file.

    settings = load_settings(path)     # raises BetelgeuseError naming the key and the problem
    settings.slots.vram_per_layer      # int, or AUTO ("auto": sized from the budgets)
    settings.budget.vram               # bytes

Every key can also come from the environment: BETELGEUSE_<SECTION>_<KEY> (BETELGEUSE_ENGINE_SUB_BATCH=8,
BETELGEUSE_MODEL_PATH=/srv/m.gguf, BETELGEUSE_WORKER_LISTEN=0.0.0.0:50051,unix:/run/b.sock), its value written
as in TOML or bare ("auto", "12GiB"). Precedence: flags > environment > file > defaults; `resolve_settings`
also says where each value came from (`betelgeuse config show`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from betelgeuse.errors import BetelgeuseError

AUTO = "auto"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(value: int | str, key: str = "size") -> int:
    """Bytes from 12884901888, "12GiB", "12G" or "1.5 GiB".

    Bare K/M/G/T follow systemd's MemoryMax= (powers of 1024); KB/MB/GB are SI, KiB/MiB/GiB binary.
    """
    if isinstance(value, bool):
        raise BetelgeuseError(f"{key}: expected a size like \"12GiB\", got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise BetelgeuseError(f"{key}: a size cannot be negative ({value})")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise BetelgeuseError(f"{key}: cannot parse size {value!r} (use bytes or e.g. \"12GiB\", \"512MiB\", \"12G\")")
    mult = 1024 ** "bkmgt".index(unit) if unit in ("k", "m", "g", "t") else _UNITS[unit]
    return int(float(m.group(1)) * mult)


def split_hostport(addr: str, key: str = "address") -> tuple[str, int]:
    """"127.0.0.1:9464" -> ("127.0.0.1", 9464); "[::1]:9464" -> ("::1", 9464)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise BetelgeuseError(f"{key}: expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class ModelSettings:
    path: str = ""                          # the GGUF file (required to serve)


@dataclass(slots=True)
class SlotSettings:
    vram_per_layer: int | str = 5           # VRAM hot slots per MoE layer, or "auto"
    host_per_layer: int | str = 15          # host-RAM slots per MoE layer, or "auto"
    vram_backing: bool = True               # VRAM experts keep a host copy (fast worker restart); false: more capacity


@dataclass(slots=True)
class BudgetSettings:
    vram: int = 12 * 1024**3                # bytes everything both processes put on the GPU may use
    memory_max: int | None = None           # bytes for both processes; None = the cgroup's memory.max


@dataclass(slots=True)
class WorkerSettings:
    # gRPC listen addresses: "HOST:PORT" or "unix:/path" (grpc syntax)
    listen: list[str] = field(default_factory=lambda: ["127.0.0.1:50051", "unix:/run/betelgeuse/api.sock"])
    metrics: str = "127.0.0.1:9464"         # HOST:PORT of /metrics; "" = off
    device: str = "auto"                    # "auto" | "cuda" | "cuda:N" | "cpu"
    http: str = "127.0.0.1:8000"            # HOST:PORT of the OpenAI-compatible HTTP API; "" = off
    max_request_bytes: int = 4 * 1024**2    # largest gRPC message the worker accepts (bytes)
    drain_grace: float = 60.0               # seconds SIGTERM lets running requests finish (fit TimeoutStopSec=90s)
    api_keys: list[str] = field(default_factory=list)   # non-empty: InferenceService needs one (metadata)
    api_key_file: str = ""                  # one API key per line (a secret kept out of this file)
    tls_cert: str = ""                      # PEM certificate chain: TCP listeners use TLS when set
    tls_key: str = ""                       # PEM private key for tls_cert
    tls_client_ca: str = ""                 # PEM CA bundle: set = clients must present a certificate (mTLS)
    store_timeout: float = 10.0             # seconds for one store control call (a Load adds per-expert time)
    store_probe_timeout: float = 2.0        # a store that does not answer a ping in this long is down


@dataclass(slots=True)
class StoreSettings:
    socket: str = "/run/betelgeuse/store.sock"     # control gRPC over a Unix socket
    fd_socket: str = "/run/betelgeuse/store.fds"   # memfd hand-off (SCM_RIGHTS)
    metrics: str = "127.0.0.1:9465"
    socket_group: str = ""                  # group allowed on the sockets (0660); "" = the service's user only (0600)


@dataclass(slots=True)
class EngineSettings:
    # defaults equal betelgeuse.config.EngineConfig's (tests/test_settings.py checks)
    schedule: str = "layer_major"           # "layer_major" | "standard"
    sub_batch: int = 16                     # tokens per expert matmul in layer-major prefill
    micro_batch: int = 3                    # tokens per micro-batch in the standard schedule
    staging_slots: int | str = AUTO         # shared slots for disk reads in flight, or "auto"
    ring_slots: int = 32                    # device slots experts stream into (two banks = launch groups)
    kernels: str = "auto"                   # expert math: "auto" | "torch" | "triton"
    decode_consolidate_every: int = 32      # decode tokens between consolidations of the decode's usage (0 = off)
    cuda_graphs: bool = True                # CUDA: decode steps replay captured graphs
    prefetch: bool = True                   # read the next layer's likely experts ahead
    routing: str = "exact"                  # "exact" | "resident" (approximate, see docs/architecture.md)
    max_context: int = 4096                 # tokens per sequence
    max_running: int = 4                    # sequences with a live KV cache at once (decoded together)
    max_queue: int = 16                     # waiting requests before RESOURCE_EXHAUSTED
    max_batched_tokens: int = 512           # prompt tokens per prefill pass while other sequences decode
    prefill_chunk: int = 64                 # tokens per position-aligned chunk = prefix-cache block size
    prefix_cache_bytes: int | str = AUTO    # device KV prefix cache in bytes (0 = off; "auto": 2 contexts, <= 512 MiB)
    dtype: str = "auto"                     # "auto" | "float32" | "bfloat16" | "float16"
    worker_reserve: int | str = AUTO        # host bytes the worker needs outside the arena, or "auto"
    read_threads: int = 8                   # concurrent preadv calls in the store
    max_prompt_bytes: int = 256 * 1024      # prompt text / chat content bytes, refused before tokenizing


@dataclass(slots=True)
class LogSettings:
    level: str = "info"                     # "debug" | "info" | "warning" | "error"
    format: str = "text"                    # "text" (logfmt fields) | "json" (one object per line)


@dataclass(slots=True)
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    slots: SlotSettings = field(default_factory=SlotSettings)
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    log: LogSettings = field(default_factory=LogSettings)


def _slot_count(value, key: str) -> int | str:
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BetelgeuseError(f"{key}: expected a slot count >= 0 or \"auto\", got {value!r}")
    return value


def _count(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BetelgeuseError(f"{key}: expected an integer >= 0, got {value!r}")
    return value


def _bool(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise BetelgeuseError(f"{key}: expected true or false, got {value!r}")
    return value


def _choice(*choices: str):
    def conv(value, key: str) -> str:
        if value not in choices:
            raise BetelgeuseError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
        return value
    return conv


def _string(value, key: str) -> str:
    if not isinstance(value, str):
        raise BetelgeuseError(f"{key}: expected a string, got {value!r}")
    return value


def _listen(value, key: str) -> list[str]:
    values = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise BetelgeuseError(f"{key}: expected an address or a list of addresses, got {value!r}")
    for v in values:
        if not v.startswith("unix:"):
            split_hostport(v, key)
    return values


def _seconds(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise BetelgeuseError(f"{key}: expected a number of seconds >= 0, got {value!r}")
    return float(value)


def _strings(value, key: str) -> list[str]:
    if isinstance(value, str):                   # from the environment: comma-separated
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BetelgeuseError(f"{key}: expected a list of non-empty strings")
    return value


def _hostport_or_off(value, key: str) -> str:
    value = _string(value, key)
    if value:
        split_hostport(value, key)
    return value


_CONVERT = {
    ("model", "path"): _string,
    ("slots", "vram_per_layer"): _slot_count,
    ("slots", "host_per_layer"): _slot_count,
    ("budget", "vram"): parse_size,
    ("budget", "memory_max"): lambda v, k: None if v == AUTO else parse_size(v, k),
    ("worker", "listen"): _listen,
    ("worker", "metrics"): _hostport_or_off,
    ("worker", "device"): _string,
    ("worker", "http"): _hostport_or_off,
    ("worker", "max_request_bytes"): parse_size,
    ("worker", "drain_grace"): _seconds,
    ("worker", "api_keys"): _strings,
    ("worker", "api_key_file"): _string,
    ("worker", "tls_cert"): _string,
    ("worker", "tls_key"): _string,
    ("worker", "tls_client_ca"): _string,
    ("worker", "store_timeout"): _seconds,
    ("worker", "store_probe_timeout"): _seconds,
    ("store", "socket_group"): _string,
    ("store", "socket"): _string,
    ("store", "fd_socket"): _string,
    ("store", "metrics"): _hostport_or_off,
    ("engine", "schedule"): _choice("layer_major", "standard"),
    ("engine", "routing"): _choice("exact", "resident"),
    ("engine", "sub_batch"): _count,
    ("engine", "micro_batch"): _count,
    ("engine", "staging_slots"): _slot_count,
    ("engine", "ring_slots"): _count,
    ("engine", "kernels"): _choice("auto", "torch", "triton"),
    ("engine", "decode_consolidate_every"): _count,
    ("engine", "cuda_graphs"): _bool,
    ("engine", "prefetch"): _bool,
    ("slots", "vram_backing"): _bool,
    ("engine", "max_context"): _count,
    ("engine", "max_running"): _count,
    ("engine", "max_queue"): _count,
    ("engine", "max_batched_tokens"): _count,
    ("engine", "prefill_chunk"): _count,
    ("engine", "prefix_cache_bytes"): lambda v, k: AUTO if v == AUTO else parse_size(v, k),
    ("engine", "dtype"): _choice("auto", "float32", "bfloat16", "float16"),
    ("engine", "worker_reserve"): lambda v, k: AUTO if v == AUTO else parse_size(v, k),
    ("engine", "read_threads"): _count,
    ("log", "level"): _choice("debug", "info", "warning", "error"),
    ("log", "format"): _choice("text", "json"),
    ("engine", "max_prompt_bytes"): parse_size,
}


def settings_from_dict(data: dict, source: str = "config") -> Settings:
    settings = Settings()
    for section, values in data.items():
        if not hasattr(settings, section) or section not in Settings.__dataclass_fields__:
            known = ", ".join(f"[{s}]" for s in Settings.__dataclass_fields__)
            raise BetelgeuseError(f"{source}: unknown section [{section}] (known: {known})")
        if not isinstance(values, dict):
            raise BetelgeuseError(f"{source}: [{section}] must be a table")
        target = getattr(settings, section)
        for key, value in values.items():
            conv = _CONVERT.get((section, key))
            if conv is None:
                known = ", ".join(f.name for f in dataclasses.fields(target))
                raise BetelgeuseError(f"{source}: unknown key {section}.{key} (known in [{section}]: {known})")
            setattr(target, key, conv(value, f"{source}: {section}.{key}"))
    return settings


ENV_PREFIX = "BETELGEUSE_"
KEYS = tuple(_CONVERT)                       # (section, key) of every setting, in file order per section


def env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section}_{key}".upper()


def _env_value(raw: str):
    """An environment value as TOML would read it (16, true, "x", [..]); anything else stays a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


@dataclass(slots=True)
class Resolved:
    settings: Settings
    sources: dict[tuple[str, str], str]      # (section, key) -> "default" | the file's path | "env NAME" | "flag --x"
    ignored_env: list[str]                   # BETELGEUSE_<SECTION>_* names that match no key (typos)

    def set(self, section: str, key: str, value, source: str) -> None:
        """An override (a flag) through the same validation as the file."""
        conv = _CONVERT[(section, key)]
        setattr(getattr(self.settings, section), key, conv(value, f"{source}"))
        self.sources[(section, key)] = source


def resolve_settings(path: str | Path | None, env: dict[str, str] | None = None) -> Resolved:
    """Defaults, then the TOML file (None: none), then BETELGEUSE_* variables of `env` (default os.environ)."""
    data = _read_toml(path) if path is not None else {}
    settings = settings_from_dict(data, str(path))
    sources = {k: "default" for k in KEYS}
    for section, values in data.items():
        for key in values:
            sources[(section, key)] = str(path)
    env = os.environ if env is None else env
    r = Resolved(settings, sources, [])
    names = {env_name(s, k): (s, k) for s, k in KEYS}
    for name, raw in env.items():
        if name in names:
            r.set(*names[name], _env_value(raw), f"env {name}")
        elif any(name.startswith(f"{ENV_PREFIX}{s.upper()}_") for s in Settings.__dataclass_fields__):
            r.ignored_env.append(name)
    return r


def load_settings(path: str | Path | None, env: dict[str, str] | None = None) -> Settings:
    """Settings from a TOML file (None: none) and BETELGEUSE_* variables of `env` (default os.environ)."""
    return resolve_settings(path, env).settings


def _toml_value(v) -> str:
    if v is None:
        return json.dumps(AUTO)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


# values `config show` never prints (a count of tokens, max_batched_tokens, is not a secret)
_SECRET = re.compile(r"(^|_)(api_keys?|passwords?|(?<!batched_)tokens?|secrets?)$")


def shown_value(key: str, value) -> str:
    """The TOML text of a value, secrets (API keys, tokens) redacted."""
    if _SECRET.search(key) and value:
        return _toml_value(["<redacted>"] * len(value) if isinstance(value, list) else "<redacted>")
    return _toml_value(value)


def render_toml(r: Resolved) -> str:
    """The effective configuration as a TOML file (it loads back to the same settings), each value
    commented with where it came from."""
    lines = []
    for section in Settings.__dataclass_fields__:
        lines.append(f"[{section}]")
        target = getattr(r.settings, section)
        rows = [(k, shown_value(k, getattr(target, k))) for s, k in KEYS if s == section]
        width = max(len(f"{k} = {v}") for k, v in rows)
        for k, v in rows:
            lines.append(f"{k} = {v}".ljust(width) + f"   # {r.sources[(section, k)]}")
        lines.append("")
    if r.ignored_env:
        lines.append("# ignored (no such key): " + ", ".join(sorted(r.ignored_env)))
    return "\n".join(lines).rstrip("\n") + "\n"


def _read_toml(path: str | Path) -> dict:
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise BetelgeuseError(f"config file {p} does not exist") from None
    except PermissionError:
        raise BetelgeuseError(f"config file {p} is not readable") from None
    except tomllib.TOMLDecodeError as e:
        raise BetelgeuseError(f"config file {p}: invalid TOML: {e}") from None
    return data
