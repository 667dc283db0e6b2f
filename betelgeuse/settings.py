"""The one configuration model (pydantic-settings), read by both processes and the CLI.

    r = resolve_settings(path, flags=...)   # defaults < the TOML file < BETELGEUSE_* environment < flags
    r.settings.slots.vram_per_layer          # int, or AUTO ("auto": sized from the budgets)
    r.sources[("budget", "vram")]            # "default" | the file's path | "env NAME" | "flag --x"

`Settings` is the only place a key is defined: its type (and check), default, help text, flag name
and, for engine keys, the EngineConfig field it feeds. From it derive the TOML file's keys
(deploy/betelgeuse.toml, installed as /etc/betelgeuse/betelgeuse.toml), the environment variables
BETELGEUSE_<SECTION>_<KEY> (BETELGEUSE_ENGINE_SUB_BATCH=8, BETELGEUSE_MODEL_PATH=/srv/m.gguf,
BETELGEUSE_WORKER_LISTEN=0.0.0.0:50051,unix:/run/b.sock; a value written as in TOML or bare: "auto",
"12GiB"), the argparse flags of the store, worker, serve, generate and bench (`add_flags`), the child
processes' arguments (`to_flags`), `betelgeuse config show` (`render_toml`) and the EngineConfig class
itself (betelgeuse/config.py builds its fields from the keys that feed the engine).
A bad value is one BetelgeuseError line naming where it came from and the key, never a ValidationError dump.
"""

import argparse
import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict, TomlConfigSettingsSource

from betelgeuse.errors import BetelgeuseError

AUTO = "auto"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


# ------------------------------------------------------------------------------------- value parsers
# Each raises ValueError with the problem; the caller prefixes where the value came from and its key.

def _size(value) -> int:
    """Bytes from 12884901888, "12GiB", "12G" or "1.5 GiB".

    Bare K/M/G/T follow systemd's MemoryMax= (powers of 1024); KB/MB/GB are SI, KiB/MiB/GiB binary."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a size like \"12GiB\", got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative ({value})")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot parse size {value!r} (use bytes or e.g. \"12GiB\", \"512MiB\", \"12G\")")
    mult = 1024 ** "bkmgt".index(unit) if unit in ("k", "m", "g", "t") else _UNITS[unit]
    return int(float(m.group(1)) * mult)


def parse_size(value: int | str, key: str = "size") -> int:
    """Bytes from a size (see _size); BetelgeuseError naming `key`."""
    try:
        return _size(value)
    except ValueError as e:
        raise BetelgeuseError(f"{key}: {e}") from None


def _hostport(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def split_hostport(addr: str, key: str = "address") -> tuple[str, int]:
    """"127.0.0.1:9464" -> ("127.0.0.1", 9464); "[::1]:9464" -> ("::1", 9464)."""
    try:
        return _hostport(addr)
    except ValueError as e:
        raise BetelgeuseError(f"{key}: {e}") from None


def _size_or_auto(value):
    return AUTO if value == AUTO else _size(value)


def _memory_max(value):                      # "auto" (or None) = the cgroup's memory.max
    return None if value in (AUTO, None) else _size(value)


def _count_or_auto(minimum: int, what: str):
    def conv(value):
        if value == AUTO:
            return AUTO
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected {what} >= {minimum} or \"auto\", got {value!r}")
        return value
    return conv


def _count(minimum: int):
    def conv(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
        return value
    return conv


def _bool(value):
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _bool_or_auto(value):
    if value != AUTO and not isinstance(value, bool):
        raise ValueError(f"expected true, false or \"auto\", got {value!r}")
    return value


def _choice(*choices: str):
    def conv(value):
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return value
    return conv


def _string(value):
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _listen(value):
    values = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if isinstance(values, list) and all(isinstance(v, str) for v in values):      # --listen a,b --listen c
        values = [p.strip() for v in values for p in v.split(",")]
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise ValueError(f"expected an address or a list of addresses, got {value!r}")
    for v in values:
        if not v.startswith("unix:"):
            _hostport(v)
    return values


def _seconds(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"expected a number of seconds >= 0, got {value!r}")
    return float(value)


def _share(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"expected a share between 0 and 1, got {value!r}")
    return float(value)


def _share_or_auto(value):
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"expected a share between 0 and 1 or \"auto\", got {value!r}")
    return float(value)


def _strings(value):
    if isinstance(value, str):                   # from the environment: comma-separated
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError("expected a list of non-empty strings")
    return value


def _hostport_or_off(value):
    value = _string(value)
    if value:
        _hostport(value)
    return value


class _Metavar(str):
    """Annotated metadata: how a flag's value is written in --help."""


def _t(base, conv, metavar: str, *extra):
    return Annotated[base, BeforeValidator(conv), _Metavar(metavar), *extra]


Size = _t(int, _size, "SIZE")
SizeOrAuto = _t(int | Literal["auto"], _size_or_auto, "SIZE|auto")
MemoryMax = _t(int | None, _memory_max, "SIZE|auto")
Slots = _t(int | Literal["auto"], _count_or_auto(0, "a slot count"), "N|auto")
Count0 = _t(int, _count(0), "N")
Count1 = _t(int, _count(1), "N")
Running = _t(int | Literal["auto"], _count_or_auto(1, "a number of sequences"), "N|auto")
Count1OrAuto = _t(int | Literal["auto"], _count_or_auto(1, "an integer"), "N|auto")
Count2 = _t(int, _count(2), "N")
Count8 = _t(int, _count(8), "N")
Seconds = _t(float, _seconds, "SECONDS")
Share = _t(float, _share, "0..1")
ShareOrAuto = _t(float | Literal["auto"], _share_or_auto, "0..1|auto")
Flag = _t(bool, _bool, "")
FlagOrAuto = _t(bool | Literal["auto"], _bool_or_auto, "auto|true|false")
Text = _t(str, _string, "TEXT")
Path_ = _t(str, _string, "PATH")
HostPortOrOff = _t(str, _hostport_or_off, "HOST:PORT")
Listen = _t(list[str], _listen, "ADDR", NoDecode)
Strings = _t(list[str], _strings, "TEXT", NoDecode)


def _choices(*values: str):
    return _t(Literal[values], _choice(*values), "{" + ",".join(values) + "}")


def setting(default: Any, help: str, example: Any, *, flag: str | None | bool = None, engine: str | None = None,
            factory=None) -> Any:
    """A key: its default, help text (the flag's --help), a non-default example (the tests round-trip it
    through every source), its flag (None: --KEY; False: no flag, e.g. a secret) and the EngineConfig field
    it feeds (keys of [engine] feed the field of their own name)."""
    extra = {"flag": flag, "engine": engine}
    if factory is not None:
        return Field(default_factory=factory, description=help, examples=[example], json_schema_extra=extra)
    return Field(default, description=help, examples=[example], json_schema_extra=extra)


# --------------------------------------------------------------------------------------- the model

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    ENGINE: ClassVar[bool] = False          # True: every key feeds the EngineConfig field of its own name


class ModelSettings(_Section):
    path: Path_ = setting("", "the GGUF file (required to serve)", "/srv/models/m.gguf", flag="--model",
                          engine="model_path")


class SlotSettings(_Section):
    # auto: VRAM slots fill the VRAM budget after the worker's fixed needs, host slots the memory budget after the
    # worker's reserve (store/plan.py); a fixed count is kept as given (and refused if it does not fit)
    vram_per_layer: Slots = setting(AUTO, "VRAM hot slots per MoE layer, or auto (sized from the VRAM budget)", 5,
                                    flag="--vram-slots", engine="vram_slots")
    host_per_layer: Slots = setting(AUTO, "host-RAM slots per MoE layer (the store's arena), or auto (sized from "
                                    "the memory budget)", 7, flag="--host-slots", engine="host_slots")
    # auto: kept only where they cost no resident expert (no memory limit, or the memory holds every expert beside
    # them); dropped where host RAM binds, their slots going to the host tier (store/plan.py)
    vram_backing: FlagOrAuto = setting(AUTO, "VRAM experts keep a host copy: true = a restarted worker refills VRAM "
                                       "from RAM; false = more distinct experts resident, a restart refills VRAM "
                                       "from disk; auto = true unless host RAM binds", False, flag="--vram-backing",
                                       engine="vram_backing")


class BudgetSettings(_Section):
    vram: Size = setting(12 * 1024**3, "bytes everything both processes put on the GPU may use", 8 * 1024**3,
                         flag="--vram-budget", engine="vram_budget")
    memory_max: MemoryMax = setting(None, "bytes of host memory for both processes; auto = the cgroup's "
                                    "memory.max", 6 * 1024**3, flag="--memory-max", engine="memory_max")


class WorkerSettings(_Section):
    listen: Listen = setting(None, "gRPC listen addresses: HOST:PORT or unix:/path (repeatable or comma-separated)",
                             ["127.0.0.1:6000", "unix:/tmp/b.sock"],
                             factory=lambda: ["127.0.0.1:50051", "unix:/run/betelgeuse/api.sock"])
    metrics: HostPortOrOff = setting("127.0.0.1:9464", "HOST:PORT of the worker's /metrics ('' = off)",
                                     "127.0.0.1:19464", flag="--worker-metrics")
    device: Text = setting("auto", "auto | cuda | cuda:N | cpu", "cpu", engine="device")
    http: HostPortOrOff = setting("127.0.0.1:8000", "HOST:PORT of the OpenAI-compatible HTTP API ('' = off)", "")
    http_max_connections: Count1 = setting(256, "open HTTP connections at most; one more is answered 503 and closed",
                                           32)
    http_header_timeout: Seconds = setting(10.0, "seconds a new HTTP connection has to send a request's headers", 3.0)
    http_body_timeout: Seconds = setting(60.0, "seconds an HTTP request's body may take to arrive", 20.0)
    http_keep_alive: Seconds = setting(5.0, "seconds an idle HTTP keep-alive connection stays open", 2.0)
    max_request_bytes: Size = setting(4 * 1024**2, "largest gRPC message the worker accepts (bytes)", 1 << 20)
    drain_grace: Seconds = setting(60.0, "seconds SIGTERM lets running requests finish (fit TimeoutStopSec=90s)", 5.5)
    api_keys: Strings = setting(None, "non-empty: every gRPC InferenceService call and every HTTP path but /health "
                                "and /metrics needs one", ["k1", "k2"],
                                flag=False, factory=list)
    api_key_file: Path_ = setting("", "file with one API key per line (a secret kept out of the config file)",
                                  "/etc/betelgeuse/keys")
    tls_cert: Path_ = setting("", "PEM certificate chain: the TCP gRPC listeners and HTTP use TLS when set",
                              "/etc/b/cert.pem")
    tls_key: Path_ = setting("", "PEM private key for tls_cert", "/etc/b/key.pem")
    tls_client_ca: Path_ = setting("", "PEM CA bundle: set = clients must present a certificate (mTLS)",
                                   "/etc/b/ca.pem")
    store_timeout: Seconds = setting(10.0, "seconds for one store control call (a Load adds per-expert time)", 3.0)
    store_probe_timeout: Seconds = setting(2.0, "a store that does not answer a ping in this many seconds is down",
                                           1.0)


class StoreSettings(_Section):
    socket: Path_ = setting("/run/betelgeuse/store.sock", "the store's control socket (gRPC over a Unix socket)",
                            "/tmp/b/store.sock", flag="--store-socket")
    fd_socket: Path_ = setting("/run/betelgeuse/store.fds", "the arena fd hand-off socket (SCM_RIGHTS)",
                               "/tmp/b/store.fds", flag="--fd-socket")
    metrics: HostPortOrOff = setting("127.0.0.1:9465", "HOST:PORT of the store's /metrics ('' = off)",
                                     "127.0.0.1:19465", flag="--store-metrics")
    socket_group: Text = setting("", "group allowed on the store's sockets (0660); '' = the service's user only",
                                 "betelgeuse")
    # the worker's loads, reads ahead and releases (the session stream only): one protobuf message a datagram on the
    # store's SOCK_SEQPACKET socket (the control socket's path + ".seq"; always served), or on gRPC. seqpacket is the
    # default since gpu-run57 (ds4-flash exact decode, one H100, the same call: the within-token deliver + message
    # hops 2.90 -> 1.07 ms a token, host 198 -> 176 us an expert application; 8.64 -> 9.50 tok/s, of which the disk
    # reading 8% faster in the second run is most: achieved of the bound 0.742 -> 0.751)
    session_transport: _choices("grpc", "seqpacket") = setting(
        "seqpacket", "the session stream's transport: seqpacket | grpc (services/grpc/session_seq.py)", "grpc")
    # who reads the seqpacket session stream's answers (services/grpc/store_client.py _SeqStream): a reader thread
    # (each answer a wakeup of it and a turn of the GIL, ~14 a decode token), or the caller that waits for one (no
    # thread; answers nobody waits for drained before each send). Issue 21, docs/benchmarks/cpu-host65: off until a
    # device A/B says the decode's host time falls with it
    # (gpu-run68, one H100: caller 140 / 142 against thread 122 / 163 / 153 µs an application: no gain beyond the
    # noise); spin: the caller whose wait busy-polls (a core kept hot: the A/B of a cold wake's cost)
    session_reader: _choices("thread", "caller", "spin") = setting(
        "thread", "who reads the seqpacket session stream's answers: thread | caller | spin", "caller")
    # the prefix cache's host tier outlives a restart of the whole service: saved when the store is idle and when it
    # stops (O_DIRECT, only what changed), loaded at start for the same model file (store/prefix_disk.py)
    prefix_save_path: Path_ = setting("", "file the store saves the prefix cache's host tier to and loads it from at "
                                      "start ('' = off)", "/var/lib/betelgeuse/prefix-cache.bin")


class EngineSettings(_Section):
    # every key feeds the EngineConfig field of its own name (betelgeuse/config.py builds that class from these)
    ENGINE: ClassVar[bool] = True
    schedule: _choices("layer_major", "standard") = setting(
        "layer_major", "layer_major (single-pass prefill) | standard (3-token micro-batches)", "standard")
    routing: _choices("exact", "resident", "pool") = setting(
        "exact", "exact | resident (APPROXIMATE: ranks >= 1 among resident experts) | pool (APPROXIMATE: every "
        "rank among resident experts, the reference report's routing)", "resident")
    record_routing: Path_ = setting("", "write every routed token's expert choices to this trace file "
                                    "(docs/benchmarks/routing-locality.md; decode runs without CUDA graphs)",
                                    "/tmp/routing.bgrt")
    sub_batch: Count1 = setting(16, "tokens per expert matmul in layer-major prefill", 8)
    micro_batch: Count1 = setting(3, "tokens per micro-batch in the standard schedule", 2)
    staging_slots: Slots = setting(AUTO, "shared slots for disk reads in flight, or auto", 12)
    # the execution ring: two banks of ring_slots/2; a bank is one batch of experts = one kernel launch group
    ring_slots: Count2 = setting(32, "device slots experts stream into (two banks = launch groups)", 16)
    # auto: triton on CUDA where the quant type allows, else torch (the reference loop); triton also runs on the
    # CPU under TRITON_INTERPRET=1
    kernels: _choices("auto", "torch", "triton") = setting("auto", "expert math: auto | torch | triton", "torch")
    # q8_1: the triton expert kernels of the types with an int8 tensor-core schedule (kernels/triton_mmq.py) take
    # their activations quantized per 32 elements to int8 (llama.cpp's mmq numerics): faster, NOT within float
    # noise of the torch path (about 1% relative error per output); off keeps the exactness contract. bf16: those
    # types' kernels multiply their integer quants as bf16 on the tensor cores against the activations as bf16 (the
    # engine's own dtype on the GPU: no rounding there), block scales applied in fp32: within float noise, opt-in
    # until the device measures it (issue 23). auto: bf16 for Q8_0 and MXFP4 only, the types where the device
    # measured it faster than the float schedule (kernels/moe.py AUTO_QTYPES)
    act_quant: _choices("off", "q8_1", "bf16", "auto") = setting(
        "off", "expert activations on the GPU: off (float, exact) | q8_1 (int8 per 32, llama.cpp's mmq numerics; "
        "approximate) | bf16 (bf16 tensor-core MMA of the integer quants; float noise) | auto (bf16 for Q8_0 and "
        "MXFP4 only)", "q8_1")
    # the VRAM slots hold their Q8_0 (and Q4_K: cpu-packk62; MXFP4: cpu-mxpk63) experts in kernels/mma_pack's layout
    # (repacked on the GPU as they fill; host slots and the ring stay GGUF), which gluon_mmq's PK form reads coalesced
    # (issue 23: Q8_0 1.6 TB/s against 1.0 at one row, gpu-run64); every launch reads each expert's layout from its
    # slot table (bit 0). The same values in the same MMA: the same bits (docs/benchmarks/cpu-pack62, cpu-vram62).
    # Startup refuses unless every packed expert launch is that form (CUDA sm_90, triton kernels, act_quant bf16, or
    # auto for Q8_0 / MXFP4; a packed layer's parts all Q8_0 / MXFP4 / Q4_K; MXFP4's packed layers take the Gluon form,
    # its shipped bf16 form being Triton's); a model with no such expert: nothing to pack. Q4_K's and MXFP4's packed
    # forms are not yet measured on the device. check_cuda's invariance / prefix / batch / pool / recycle rows pass
    # with it on (gpu-run64, Q8_0, act_quant bf16: the same verdicts as bf16 unpacked). Off: act_quant's default (off)
    # is not a form it can pack for, and the decode A/B through the service has not run yet
    pack_experts: Flag = setting(False, "VRAM-resident Q8_0 / MXFP4 / Q4_K experts held in the packed layout the "
                                 "Gluon MMA reads coalesced (CUDA sm_90, act_quant bf16; auto for Q8_0 / MXFP4)", True)
    # the VRAM slots hold their Q8_0 / Q4_K experts in kernels/tile_layout's 64-row tiles (retiled on the device as they
    # fill; host slots, staging, flex and the ring stay GGUF), which triton_moe's float kernels (act_quant off, the
    # default; auto for Q4_K) read as runs where GGUF order gave a row's 68 bytes at a time: gpu-run65 (H200, the
    # kernels alone) tiled / GGUF 1.29 / 1.22 for Q8_0, 1.33 / 1.28 for Q4_K at 1 / 16 rows, the same bits. Every launch
    # reads each expert's layout from its slot table (bit 0). A layer that cannot (another type, shapes not whole
    # tiles, triton_mmq's MMA under act_quant, the torch kernels, a packed layer: packing wins) stays GGUF, logged.
    # Off until check_cuda's rows and the decode A/B run with it on the device (cpu-tile63)
    tile_experts: Flag = setting(False, "VRAM-resident Q8_0 / Q4_K experts held in 64-row tiles the float expert "
                                 "kernels read as runs (triton kernels, act_quant off; auto for Q4_K)", True)
    # a long generation's working set moves into the resident tiers while it runs
    decode_consolidate_every: Count0 = setting(32, "decode tokens between consolidations of the decode's usage "
                                               "(0 = end of request only)", 0)
    # host-dependent layers stay eager
    cuda_graphs: Flag = setting(True, "CUDA: decode steps replay captured graphs", False)
    prefetch: Flag = setting(True, "read the next layer's likely experts ahead during prefill", False)
    # decode: layer l+1's router applied to layer l's residual guesses its experts; the guessed disk ones are read
    # ahead (worker/guess.py). Only when bytes arrive changes, never a bit of the output
    prefetch_decode: Flag = setting(True, "decode: guess the next layer's experts and read the disk ones ahead", False)
    # decode: the next layer's guessed host-tier experts that the step banks (not read in place) are copied into a
    # ring bank at layer l, on the copy stream, so layer l+1 finds them on the GPU (worker/moe_step.py, copy ahead).
    # Only where and when bytes arrive changes, never a bit. auto: in `pool` routing (every expert resident: the
    # host tier's copies are decode's bound, issue 21); exact routing's A/B is not measured yet
    prefetch_host: _choices("auto", "on", "off") = setting(
        "auto", "decode: copy the guessed next layer's banked host-tier experts ahead into a ring bank: on | off | "
        "auto (pool routing)", "on")
    # decode: the hash-routed layers' experts (deepseek4: layers 0 .. n_hash-1 choose by token id) of a step's tokens
    # are read from disk at the step's start, before layer 0's attention and routing (worker/moe_step.py hash_ahead;
    # exact routing, with prefetch_decode). Only when bytes arrive changes, never a bit. Off: on ds4-flash (H100,
    # docs/benchmarks/gpu-run50-ds4) it moved the disk's idle between tokens 3.64 -> 3.58 ms a token and TG not at all
    # (10.30 / 10.28 tok/s): that gap is the last layers' and the sampling's time, before any step starts; and its
    # message a step cost ~14 us of host an expert application
    prefetch_hash: Flag = setting(False, "decode: read the hash-routed layers' experts of a step's tokens at its "
                                  "start", True)
    # how many layers ahead decode guesses (layers l+1 .. l+depth from layer l's residual; 1 = the next layer only).
    # 3: the depth the live service was measured at (docs/benchmarks/gpu-run26-serve); in-process on 16 bench layers
    # depths 1-3 decode equally fast within the disk's noise (gpu-run27-fusedguess), depth 3 wasting ~2x the read-ahead
    # the worker keeps copies of recently read experts in the VRAM the plan reserves for sequences not running
    # (worker/flex_cache.py); given back before a sequence's KV needs it. Only where bytes come from changes. auto: on
    # CUDA; off on the CPU, the tests' path, whose tier tests count which tier each expert came from
    flex_cache: FlagOrAuto = setting(AUTO, "keep copies of recently read experts in the VRAM reserved for sequences "
                                     "not running (given back when they run): true | false | auto (on CUDA)", False)
    # decode computes every routed expert it holds (VRAM slots, flex copies, host slots read in place over PCIe) in
    # ONE launch group right after routing, inside the decode graphs, and goes to the host only for the misses
    # (worker/at_hand.py). Only which group computes a row changes, never a bit. auto: on
    decode_at_hand: FlagOrAuto = setting(AUTO, "decode: one in-graph expert group for every expert held (VRAM, flex, "
                                         "host read in place), the host path for disk misses only: true | false | "
                                         "auto (on)", True)
    # where the at-hand group finds a host-tier expert (worker/at_hand.py): always = read in place over PCIe by the
    # kernels (no copy), never = copied into a ring bank by the copy engine as the partial path does (VRAM and flex
    # experts stay in the group), auto = in place for steps of at most at_hand.IN_PLACE_MAX_ROWS rows, banked
    # above and for the expert types in at_hand.BANKED_TYPES (MXFP4). Only where the bytes come from changes, never
    # a bit
    host_in_place: _choices("auto", "always", "never") = setting(
        "auto", "decode: host-tier experts read in place over PCIe by the kernels (always), copied into ring banks "
        "(never), or in place for one-row steps only (auto; MXFP4 experts banked)", "never")
    # decode launches the whole step ahead, each layer not wholly in VRAM gated on the device (worker/gate.py): no
    # per-layer host sync; the host computes the misses on a side stream. Needs decode_at_hand. off until the device
    # check (deploy/device/check_gate.py) passed; auto = on CUDA
    decode_gate: _choices("off", "on", "auto") = setting("off", "decode: launch the step ahead, each layer gated on "
                                                          "the device, the host on a side stream for the misses only: "
                                                          "off | on | auto (on CUDA)", "on")
    # decode's eager expert groups (a miss layer's, between the decode graphs' segments) replay a CUDA graph keyed
    # by every argument of their two launches (the Routing's, pool's and slot-table row's addresses, the layer, the
    # shapes) instead of launching gate_up + down: captured at a key's second sighting (worker/group_graphs.py). The
    # same kernels on the same arguments: never a bit changes. CUDA with the triton kernels only (on the CPU: nothing
    # happens); off until the device A/B (deploy/device/group_graph.py, decode_host.py --group-graphs)
    group_graphs: Flag = setting(False, "decode: a miss layer's eager expert groups replay CUDA graphs captured "
                                 "per group instead of launching (CUDA only)", True)
    # the decode graphs take each layer's routing-sync start (its D2H copies into a pinned buffer and an external
    # event) inside the layer's graph, before the at-hand group: one replay and one host part a layer, not two of each
    # (worker/moe_step.py MoEStep.hand_fold; issue 21: the steady tokens' rest); the solo graphs in the layer's graph,
    # the lanes (the engine's decode) at the end of post[l] with the at-hand group (runner._lane_fold, lanesfold57).
    # Never a bit changes (CPU tests; on CUDA: its tests and check_ds4 / check_cuda's decode rows, gpu-run63). On:
    # the rest of a decode application 44.4 -> 35.7 µs (gpu-run61-h100), host 182.7 -> 150.4 with stream points (gpu-run63)
    decode_fold: Flag = setting(True, "decode: the decode graphs (solo, lanes) capture each layer's routing-sync "
                                "start in the layer's graph (CUDA: one replay a layer fewer)", False)
    # a decode miss layer's direct flex copies and the at-hand table's uploads are followed by a compute-stream point
    # that makes no CUDA call (worker/expert_cache.py StreamPoint: passed by the next routing sync's or the pass end's
    # host synchronization) instead of a recorded CUDA event (3 torch calls a miss layer; issue 21, cpu-host60). Never
    # a bit changes where the points' rule holds (CPU tests); a release it got wrong would change bits on CUDA: its
    # CUDA tests and the decode, batch, pool and recycle checks with CHECK_STREAM_POINTS=1 pass (gpu-run63)
    stream_points: Flag = setting(True, "decode: compute-stream points with no CUDA call instead of recorded events "
                                  "after a miss layer's flex copies and table uploads (CUDA only)", False)
    # decode's few rows (T <= 64) in one Triton launch per call where the library ran a split-K gemm and its reduce per
    # product: deepseek4's dense projections (kernels/triton_ds4.py TritonOps.linears / grouped_linear: u's 2-7, q_b's,
    # attn_output_a's groups, attn_output_b, the router, the shared expert) and every model's routing sort (kernels/
    # triton_moe.py sort_rows: one launch for ~8). Rows independent (a fixed K order whatever T: invariant 6); the bits
    # differ from the library's within float noise (CPU: unchanged). On since its device check (gpu-run63, H100:
    # check_ds4's ops, decode, batch, launches and prefix rows with CHECK_DECODE_GEMV=1; ds4-flash exact decode 61.9
    # -> 37.4 launches a layer, the within-token gpu link 5.18 -> 3.80 ms a token; docs/benchmarks/cpu-gemv60)
    decode_gemv: Flag = setting(True, "decode: dense projections and the routing sort of a few rows in one Triton "
                                "launch each (CUDA only; deepseek4's projections, every model's sort)", False)
    # a decode miss layer's landed disk experts are copied and computed (one ring-bank copy + group) as soon as the
    # next one has not landed yet (LoadStream.ready), not all after the layer's last: the first ones' copies and group
    # overlap the later ones' reads (issue 21: the chain's copy link, gpu-run60-h200). Each row's output by the same
    # kernel whatever its group, ranks reduced in order: never a bit changes (CPU tests); each early flush is one
    # group more (its host time). Off until the device A/B (docs/benchmarks/cpu-flush57)
    disk_flush_early: Flag = setting(False, "decode: a miss layer's landed disk experts are copied and computed as "
                                     "soon as the next one has not landed, not after the layer's last", True)
    # a decode miss layer's disk expert that lands while the next has not (LoadStream.ready) has its H2D copy issued
    # at once (into the flex slot or ring-bank slot it is computed in, on the stream its copy uses), not all after the
    # layer's last: the copies run while the disk reads the rest (issue 21: the within-token `copy` link, cpu-copy65).
    # The layer's experts are still computed by ONE group after the last lands (the same table, slots and kernels as
    # off): only when bytes move changes, never a bit (CPU tests); no group or launch more. Off until its device A/B
    disk_copy_early: Flag = setting(False, "decode: a miss layer's landed disk experts are copied to the GPU as soon "
                                    "as the next one has not landed; still one group after the last", True)
    # a released sequence state is kept with its captured decode graphs and handed, reset to a fresh state's bits in
    # the same tensors, to the next sequence of its size, and the engine (and the bench) capture decode's graphs at
    # start over one (worker/runner.py new_cache / warm_graphs): a request's first decode tokens replay instead of
    # running eagerly and capturing (issue 21: 18-48 ms of host each). Never a bit changes (CPU tests with a stand-in
    # capture). CUDA with cuda_graphs only; on since its device check passed (gpu-run61: check_cuda --only recycle and
    # check_ds4 --only decode, solo and lanes; the first decode token's host 49.6 -> 10-14 ms on ds4-flash)
    recycle_states: Flag = setting(True, "decode: keep a finished sequence's state and decode graphs for the next "
                                   "sequence of its size, and capture decode's graphs at start (CUDA only)", False)
    # attach compiles decode's kernel variants (MoEStep.warm_routes / warm_kernels, worker/warm_decode.py) so the
    # first timed token compiles none (issue 21); off: they compile in the first decode token instead (the A/B of
    # what the warm-ups put on the GPU: worker/attach_steps.py measures each step). A warm-up that fails never stops
    # attach. Never a bit of the output changes
    warm_up: _choices("on", "off") = setting("on", "compile decode's kernel variants at attach, not in the first "
                                             "decode token: on | off", "off")
    # auto: the architecture's own depth (the model class's GUESS_DEPTH, model/interface.py)
    prefetch_depth: Count1OrAuto = setting(AUTO, "decode: layers ahead whose experts are guessed and read ahead, or "
                                           "auto (the architecture's default)", 2)
    # the waste budget (worker/guess.py): a layer's guesses from d layers back are read ahead only while their hit
    # rate (used / guessed on disk, online per attachment) is at least this; 0 reads every guess; auto: the
    # architecture's own (the model class's guess_min_hit, model/interface.py)
    prefetch_min_hit: ShareOrAuto = setting(AUTO, "decode: the hit rate a guessing depth needs for its guesses to be "
                                            "read ahead (0 = read every guess), or auto (the architecture's)", 0.25)
    # a decode step's guesses (worker/guess.py, batch rule): rows = each guessed expert classed by how many running
    # rows guessed it (and top-1 guesses; a lone stream's all one class), each class within the hit-rate budget, a
    # batch's reads ahead of a layer capped at its expected disk experts; ranks = rows, with a lone stream's guesses
    # classed by their rank in its guessed top-k (top-1, 2-3, 4..k; the hash-routed layers' one class, as rows: their
    # guesses are exact), for A/B runs (not measured on a device yet); union = every row's guesses alike, uncapped
    # (the rule before; A/B runs)
    prefetch_batch_rule: _choices("rows", "union", "ranks") = setting(
        "rows", "decode: how guesses are classed for the read-ahead budget: rows (by the rows that guessed an "
        "expert) | ranks (rows, a lone stream's guesses by their rank) | union", "ranks")
    max_context: Count8 = setting(4096, "tokens per sequence (KV cache length)", 2048)
    # the slot plan reserves KV for max_running x max_context tokens and decode graphs for max_running sequences;
    # auto: as many as fit (1..8) beside a minimum of VRAM expert slots per layer (store/plan.py plan_running)
    max_running: Running = setting(AUTO, "sequences with a live KV cache at once (decoded together), or auto (as "
                                   "many as the VRAM budget holds, 1-8, beside a minimum of VRAM expert slots)", 2)
    # an idle engine waits this long after a request arrives before it starts a prefill pass, so that requests
    # arriving together (milliseconds apart) share one pass instead of the rest waiting for all of the first one's
    admission_window: Seconds = setting(0.02, "seconds an idle engine gathers requests arriving together into one "
                                        "prefill pass (0 = start at once)", 0.0)
    max_queue: Count0 = setting(16, "waiting requests before Generate answers RESOURCE_EXHAUSTED", 4)
    # chunked prefill: a long prompt no longer stalls running decodes; also the prompt tokens of several prompts
    # prefilled together (EngineConfig.prefill_pass_tokens)
    max_batched_tokens: Count1 = setting(512, "prompt tokens per prefill pass while other sequences decode", 256)
    # attention and routing run in position-aligned chunks of this size, so a prefix-cache hit is bit-identical
    # to a miss; the engine and the reference model must agree on it. auto: the architecture's own (the model class's
    # prefill_chunk, model/interface.py: qwen3moe 64, deepseek4/41 256), at most max_batched_tokens; the runner
    # resolves it (EngineConfig.chunk_for)
    prefill_chunk: Count1OrAuto = setting(AUTO, "tokens per position-aligned prefill chunk = the prefix cache's "
                                          "block / checkpoint grid, or auto (the architecture's: qwen3moe 64, "
                                          "deepseek4/41 256)", 32)
    # the slot plan subtracts it from the VRAM budget
    prefix_cache_bytes: SizeOrAuto = setting(AUTO, "device KV prefix cache in bytes (0 = off; auto: two contexts, "
                                             "<= 512 MiB)", 1 << 30)
    # a memfd the store owns (it outlives the worker): blocks evicted from the device cache spill there, and a
    # restarted worker finds them; the slot plan counts it in the memory budget, before the host expert slots
    prefix_host_bytes: SizeOrAuto = setting(AUTO, "host-RAM tier of the prefix cache, held by the store (0 = off; "
                                            "auto: 2 x the device cache, <= 1/16 of the free memory)", 1 << 30)
    dtype: _choices("auto", "float32", "bfloat16", "float16") = setting(
        "auto", "compute dtype: auto = float32 on CPU, bfloat16 on CUDA", "float32")
    # torch, the CUDA context, the dense weights' staging
    worker_reserve: SizeOrAuto = setting(AUTO, "host bytes the worker needs outside the arena, or auto", 2 << 30)
    read_threads: Count1 = setting(8, "concurrent preadv calls in the store", 4)
    read_request_bytes: Size = setting(4 * 1024**2, "bytes of one preadv call in the store", 1 << 20)
    # the store's session reader reads the first piece of each load's demand reads itself once it has queued them (it
    # would block in its recv next): no reader thread's wake-up and GIL hand-over before the disk starts (the chain's
    # store link -24 to -44% idle on 2 vCPUs, docs/benchmarks/cpu-store61); the session's next message then waits for
    # that piece (<= read_request_bytes). Off until measured on the device: that CPU's busy mode (out of cores) lost
    # more elsewhere in the chain than the store link gained
    session_reads: Flag = setting(False, "the store's session reader reads each load's first piece itself", True)
    # placement (store/residency.py): a disk expert displaces a resident one only past a margin (off: the ranking
    # alone, for A/B runs); a consolidation places at most the new experts the disk can read before the next one
    # (fill_budget: off until measured on the device, issue 24)
    placement_hysteresis: Flag = setting(True, "a disk expert takes a resident one's slot only past a margin", False)
    fill_budget: Flag = setting(False, "bound each consolidation's fills by what the disk reads before the next one",
                                True)
    engram_cache_bytes: Size = setting(64 * 1024**2, "deepseek41: the store's LRU cache of Engram rows, in the arena "
                                       "(0 = off)", 0)
    engram_read_depth: Count1 = setting(32, "deepseek41: concurrent 4 KiB O_DIRECT Engram row reads in the store", 64)
    max_prompt_bytes: Size = setting(256 * 1024, "prompt text / chat content bytes, refused before tokenizing",
                                     1 << 20)
    # never on the engine thread
    tokenize_threads: Count1 = setting(2, "requests tokenized at once (on the RPC threads)", 4)


class LogSettings(_Section):
    level: _choices("debug", "info", "warning", "error") = setting("info", "debug | info | warning | error",
                                                                 "debug", flag="--log-level")
    format: _choices("text", "json") = setting("text", "text (key=value fields) | json (one object per line)",
                                             "json", flag="--log-format")


ENV_PREFIX = "BETELGEUSE_"


class Settings(BaseSettings):
    """Every section of the file. Settings() is the defaults alone (it reads no file and no environment:
    resolve_settings gathers those itself, to say where each value came from)."""
    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True, env_prefix=ENV_PREFIX,
                                      env_nested_delimiter="_", env_nested_max_split=1, case_sensitive=False)

    model: ModelSettings = Field(default_factory=ModelSettings)
    slots: SlotSettings = Field(default_factory=SlotSettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings,)


SECTIONS: dict[str, type[_Section]] = {name: f.annotation for name, f in Settings.model_fields.items()}


@dataclass(frozen=True, slots=True)
class Key:
    """One key of the model, with everything derived from its definition."""
    section: str
    key: str
    field: FieldInfo

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def env(self) -> str:
        return env_name(self.section, self.key)

    @property
    def flag(self) -> str | None:
        f = (self.field.json_schema_extra or {}).get("flag")
        return None if f is False else (f or "--" + self.key.replace("_", "-"))

    @property
    def engine(self) -> str | None:
        e = (self.field.json_schema_extra or {}).get("engine")
        return e or (self.key if SECTIONS[self.section].ENGINE else None)

    @property
    def default(self):
        return self.field.get_default(call_default_factory=True)

    @property
    def check(self) -> Callable[[Any], Any]:
        """The key's converter: a value as the file would hold it -> the value (ValueError naming the problem)."""
        return next((m.func for m in self.field.metadata if isinstance(m, BeforeValidator)), lambda v: v)

    @property
    def example(self):
        return self.field.examples[0]

    @property
    def is_bool(self) -> bool:
        return self.field.annotation is bool

    @property
    def is_bool_or_auto(self) -> bool:
        """true | false | "auto": --KEY [auto|true|false] (bare: true) and --no-KEY."""
        return self.field.annotation == (bool | Literal["auto"])

    @property
    def is_text(self) -> bool:
        """A string (or a choice of strings): environment and flag text is taken as it is."""
        a = self.field.annotation
        return a is str or (get_origin(a) is Literal and all(isinstance(v, str) for v in get_args(a)))

    @property
    def metavar(self) -> str:
        return next((m for m in self.field.metadata if isinstance(m, _Metavar)), "VALUE")


def env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section}_{key}".upper()


KEYS_INFO: tuple[Key, ...] = tuple(Key(s, k, f) for s, cls in SECTIONS.items() for k, f in cls.model_fields.items())
KEYS = tuple((k.section, k.key) for k in KEYS_INFO)        # (section, key) of every setting, in file order
BY_KEY = {(k.section, k.key): k for k in KEYS_INFO}
assert len({k.flag for k in KEYS_INFO if k.flag}) == len([k for k in KEYS_INFO if k.flag]), "two keys share a flag"
assert all(k.field.examples for k in KEYS_INFO), "every key has an example"


# ------------------------------------------------------------------------------------ the sources

def from_text(key: Key, raw):
    """A value written as text (an environment variable, a flag) as TOML would read it: 16, true, "x", [..];
    anything else (auto, 12GiB, a path) stays the text. Strings are taken as they are (a quoted one unquoted)."""
    if not isinstance(raw, str):
        return raw
    if key.is_text and not (len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'"):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source (BETELGEUSE_<SECTION>_<KEY>, split once after the section),
    reading a given mapping (tests) instead of os.environ."""

    def __init__(self, environ):
        self._environ = environ
        super().__init__(Settings)

    def _load_env_vars(self):
        return {k.lower(): v for k, v in self._environ.items()}


def _read_env(environ) -> tuple[dict, dict, list[str]]:
    """{section: {key: value}} of the BETELGEUSE_* variables, their names, and those that match no key."""
    data, names, ignored = {}, {}, []
    for section, values in _Environment(environ)().items():
        if not isinstance(values, dict):            # BETELGEUSE_ENGINE=... itself: not a key
            continue
        for key, raw in values.items():
            k = BY_KEY.get((section, key))
            if k is None or isinstance(raw, dict):
                ignored.append(env_name(section, key))
                continue
            data.setdefault(section, {})[key] = from_text(k, raw)
            names[(section, key)] = f"env {k.env}"
    return data, names, ignored


def _read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise BetelgeuseError(f"config file {p} does not exist")
    try:
        return TomlConfigSettingsSource(Settings, toml_file=p).toml_data
    except PermissionError:
        raise BetelgeuseError(f"config file {p} is not readable") from None
    except IsADirectoryError:
        raise BetelgeuseError(f"config file {p} is a directory") from None
    except tomllib.TOMLDecodeError as e:
        raise BetelgeuseError(f"config file {p}: invalid TOML: {e}") from None


@dataclass(slots=True)
class Resolved:
    settings: Settings
    sources: dict[tuple[str, str], str]      # (section, key) -> "default" | the file's path | "env NAME" | "flag --x"
    ignored_env: list[str]                   # BETELGEUSE_<SECTION>_* names that match no key (typos)


def _one_line(err: ValidationError, where: dict, file: str) -> str:
    """The first problem of a ValidationError as one line: where the value came from, the key, what is wrong."""
    e = err.errors()[0]
    loc = tuple(str(x) for x in e["loc"])
    section = loc[0]
    if section not in SECTIONS:
        known = ", ".join(f"[{s}]" for s in SECTIONS)
        return f"{file}: unknown section [{section}] (known: {known})"
    if len(loc) == 1:
        return f"{file}: [{section}] must be a table"
    key = loc[1]
    if e["type"] == "extra_forbidden":
        known = ", ".join(SECTIONS[section].model_fields)
        return f"{where.get((section, key), file)}: unknown key {section}.{key} (known in [{section}]: {known})"
    msg = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
    return f"{where.get((section, key), f'{file}: {section}.{key}')}: {msg}"


def _given(values: dict[tuple[str, str], tuple[Any, str]]) -> tuple[dict, dict, dict]:
    """A layer of single values ((section, key) -> (value, its label)): (data, labels, where)."""
    data: dict = {}
    for (section, key), (value, _) in values.items():
        data.setdefault(section, {})[key] = value
    return (data, {k: label for k, (_, label) in values.items()},
            {k: f"{label} ({k[0]}.{k[1]})" for k, (_, label) in values.items()})


def resolve_settings(path: str | Path | None, env: dict[str, str] | None = None,
                     flags: dict[tuple[str, str], tuple[Any, str]] | None = None, data: dict | None = None,
                     defaults: dict[tuple[str, str], tuple[Any, str]] | None = None) -> Resolved:
    """Defaults (the model's, then a command's own `defaults`, same shape as `flags`), then the TOML file (None:
    none; or `data`, its contents), then BETELGEUSE_* variables of `env` (default os.environ), then `flags`
    ((section, key) -> (value, "flag --x")); validated once."""
    file = str(path) if path is not None else "config"
    layers = [_given(defaults or {})]             # (data, {(section, key): source label}, {(section, key): where})
    if path is not None or data is not None:
        data = _read_toml(path) if data is None else data
        keys = {(s, k) for s, vals in data.items() if isinstance(vals, dict) for k in vals}
        layers.append((data, {k: file for k in keys}, {k: f"{file}: {k[0]}.{k[1]}" for k in keys}))
    env_data, env_names, ignored = _read_env(os.environ if env is None else env)
    layers.append((env_data, env_names, env_names))
    layers.append(_given(flags or {}))
    merged: dict = {}
    sources = {k: "default" for k in KEYS}
    where: dict = {}
    for values, labels, wheres in layers:
        for section, vals in values.items():
            if not isinstance(vals, dict) or not isinstance(merged.get(section, {}), dict):
                merged[section] = vals
                continue
            merged.setdefault(section, {}).update(vals)
        sources.update({k: v for k, v in labels.items() if k in sources})
        where.update(wheres)
    try:
        settings = Settings(**merged)
    except ValidationError as e:
        raise BetelgeuseError(_one_line(e, where, file)) from None
    return Resolved(settings, sources, ignored)


def load_settings(path: str | Path | None, env: dict[str, str] | None = None) -> Settings:
    """Settings from a TOML file (None: none) and BETELGEUSE_* variables of `env` (default os.environ)."""
    return resolve_settings(path, env).settings


def settings_from_dict(data: dict, source: str = "config") -> Settings:
    """Settings from a TOML table (no environment): what the file `source` holding `data` gives."""
    return resolve_settings(source, env={}, data=data).settings


# ------------------------------------------------------------------------------------------- flags

def add_flags(p: argparse.ArgumentParser, sections=None, exclude=(), aliases: dict[str, str] | None = None,
              group: str | None = None, defaults: dict[str, Any] | None = None) -> None:
    """One flag per key of `sections` (default: all) but `exclude` ("section.key"), named, typed and described
    by the model; each defaults to None (not given: the file, the environment or the default decides).
    `aliases`: "section.key" -> another spelling of its flag (the store's and worker's --metrics); `defaults`:
    "section.key" -> the command's own default, shown in the help (the command passes it to resolve_settings)."""
    g = p.add_argument_group(group) if group else p
    for k in KEYS_INFO:
        if k.flag is None or (sections is not None and k.section not in sections) or k.name in exclude:
            continue
        names = [k.flag] + ([aliases[k.name]] if aliases and k.name in aliases else [])
        default = (defaults or {}).get(k.name, k.default)
        shown = _toml_value(default) if not isinstance(default, list) else ",".join(default)
        help_ = f"{k.field.description} (default {shown}; env {k.env}; [{k.section}] {k.key})".replace("%", "%%")
        if k.is_bool:
            g.add_argument(*names, dest=k.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif k.is_bool_or_auto:
            g.add_argument(*names, dest=k.name, nargs="?", const=True, default=None, metavar=k.metavar, help=help_)
            g.add_argument("--no-" + k.flag[2:], dest=k.name, action="store_const", const=False,
                           help=f"the same as {k.flag} false")
        elif get_origin(k.field.annotation) is list:
            g.add_argument(*names, dest=k.name, action="append", default=None, metavar=k.metavar, help=help_)
        else:
            g.add_argument(*names, dest=k.name, default=None, metavar=k.metavar, help=help_)


def flag_values(ns: argparse.Namespace) -> dict[tuple[str, str], tuple[Any, str]]:
    """The keys given as flags in a namespace add_flags filled: (section, key) -> (value, "flag --x")."""
    out = {}
    for k in KEYS_INFO:
        v = getattr(ns, k.name, None)
        if v is None or k.flag is None:
            continue
        flag = k.flag if v is not False or not (k.is_bool or k.is_bool_or_auto) else "--no-" + k.flag[2:]
        out[(k.section, k.key)] = (from_text(k, v) if not isinstance(v, list) else v, f"flag {flag}")
    return out


def to_flags(values: dict[tuple[str, str], Any]) -> list[str]:
    """Flags that set these values (a child process's arguments); add_flags + flag_values read them back."""
    argv = []
    for (section, key), v in values.items():
        k = BY_KEY[(section, key)]
        if k.flag is None:
            raise BetelgeuseError(f"{k.name} has no flag (set it in the file or as {k.env})")
        if k.is_bool or (k.is_bool_or_auto and isinstance(v, bool)):
            argv.append(k.flag if v else "--no-" + k.flag[2:])
        elif isinstance(v, list):
            for item in v:
                argv += [k.flag, item]
        else:
            argv += [k.flag, AUTO if v is None else str(v)]
    return argv


# -------------------------------------------------------------------------------------- config show

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
    for section in SECTIONS:
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
