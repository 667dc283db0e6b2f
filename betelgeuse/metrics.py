"""Every Prometheus metric Betelgeuse exports, defined here and nowhere else.

Each process serves its own /metrics (no multiprocess mode: it drops the process_* collectors and
Info metrics). `make_worker_metrics()` / `make_store_metrics()` build a fresh CollectorRegistry
each, so two processes, or many tests in one process, never collide.

Conventions (Prometheus naming guide; vLLM/llama.cpp precedents): prefix `betelgeuse_`, base units
(seconds, bytes), counters for anything that accumulates; PP and TG tok/s are
rate(tokens) / rate(busy seconds{phase}) in PromQL. Low-cardinality labels only:
phase = prefill|decode, tier = vram|host|disk, reason = demand|prefetch, kind = current|max.
Label children are created up front so every series exists (at 0) from the first scrape.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from typing import Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, PlatformCollector,
                               ProcessCollector, start_http_server)

PHASES = ("prefill", "decode")
TIERS = ("vram", "host", "disk")           # where an expert was read from (api.Usage expert_reads_*)
SLOT_TIERS = ("vram", "host", "staging")   # api.ServerInfo.slots_used keys
READ_REASONS = ("demand", "prefetch")
GUESS_OUTCOMES = ("hit", "miss")           # decode's guessed experts (worker/guess.py)
GUESS_BYTES = ("used", "wasted")           # bytes read ahead for them
FINISH_REASONS = ("stop", "length", "cancelled")  # api.FinalEvent.finish_reason
RPC_METHODS = ("Generate", "Tokenize", "Detokenize", "GetModelInfo", "GetServerInfo")
RPC_CODES = ("OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
             "UNAVAILABLE", "INTERNAL")    # grpc.StatusCode names we emit

# Seconds. Disk-bound prefill of a long prompt can take minutes, decode seconds per token.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120)
DISK_READ_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def torch_cuda_version() -> str:
    """The CUDA version torch was built for ('13.0'; 'none' for a CPU build or no torch), read from
    torch/version.py without importing torch, so the store (which never imports it) and the worker
    report the same value."""
    import importlib.util
    import re
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "none"
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return "unknown"
    return m.group(1) if m else "none"


def _build_info(reg: CollectorRegistry, role: str, version: str) -> Info:
    info = Info("betelgeuse_build", "Build metadata (value 1).", registry=reg)
    # metadata only: the store must not pay torch's import (hundreds of MB under the same MemoryMax)
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    cuda = torch_cuda_version()
    info.info({"version": version, "role": role, "python_version": platform.python_version(),
               "torch_version": torch_version, "cuda_version": cuda})
    return info


def _expert_slots_gauge(reg: CollectorRegistry) -> Gauge:
    """Both roles' slot gauge (one name, one help): the worker sets tiers vram and staging, the store tier host."""
    return Gauge("betelgeuse_expert_slots", "Expert slots by tier and state (used|free).", ["tier", "state"],
                 registry=reg)


def _cgroup_gauge(reg: CollectorRegistry) -> Gauge:
    return Gauge("betelgeuse_cgroup_memory_bytes",
                 "The process's cgroup memory: kind=current (memory.current) and kind=max (the "
                 "tightest memory.max up the hierarchy, i.e. the slice's limit).",
                 ["kind"], registry=reg)


class _CgroupReader:
    """Both roles' set_cgroup_reader: their `cgroup_memory` gauge (_cgroup_gauge) read through callbacks. No fields
    and empty __slots__, so the slotted dataclasses below stay slotted."""

    __slots__ = ()

    def set_cgroup_reader(self, current: Callable[[], float], maximum: Callable[[], float]) -> None:
        # callbacks run at scrape time, so the value is never stale
        self.cgroup_memory.labels(kind="current").set_function(current)
        self.cgroup_memory.labels(kind="max").set_function(maximum)


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)   # process_resident_memory_bytes, process_cpu_seconds_total, ...
    PlatformCollector(registry=reg)  # python_info
    return reg


@dataclass(slots=True)
class WorkerMetrics(_CgroupReader):
    registry: CollectorRegistry
    build_info: Info
    model_info: Info
    ready: Gauge                      # 1 once the model is loaded and the store attached
    prompt_tokens: Counter            # tokens prefilled
    generation_tokens: Counter        # tokens generated
    busy_seconds: Counter             # [phase] wall seconds the engine spent in each phase
    ttft: Histogram                   # seconds, arrival -> first token
    inter_token: Histogram            # seconds between consecutive tokens of one request
    request_duration: Histogram       # seconds, arrival -> final event (end to end)
    request_queue: Histogram          # seconds waiting before the first pass
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    requests: Counter                 # [method, code] finished RPCs by gRPC status code name
    requests_finished: Counter        # [finish_reason] completed generations
    requests_running: Gauge
    requests_waiting: Gauge           # queue depth
    expert_reads: Counter             # [tier, phase] expert loads by the tier they were read from
    disk_wait_seconds: Counter        # [phase] seconds compute stalled waiting for disk-resident experts
    h2d_bytes: Counter                # bytes copied host -> device (experts and staging)
    h2d_seconds: Counter              # seconds the copy stream was busy (effective GB/s = bytes / seconds)
    expert_slots: Gauge               # [tier, state] worker tiers: vram, staging
    vram_used_bytes: Gauge            # [pool] dense_weights | experts | kv_cache | workspace
    vram_budget_bytes: Gauge
    prefix_cache_queries: Counter     # lookups, one per prefilled request
    prefix_cache_hits: Counter        # lookups that reused >= 1 block
    prefix_cache_tokens: Counter      # prompt tokens served from the cache
    prefix_cache_evictions: Counter   # blocks evicted (LRU, unreferenced only)
    prefix_cache_refused: Counter     # entries that did not fit even with every unheld one evicted (snapshots)
    prefix_cache_bytes: Gauge         # bytes of cached blocks
    prefix_cache_capacity: Gauge      # bytes of the pool (0 = off)
    prefix_cache_usage: Gauge         # used / capacity, 0..1 (0 when off)
    prefix_cache_held: Gauge          # blocks (snapshots) running requests hold: unevictable; 0 when idle
    prefix_host_hits: Counter         # lookups that reused >= 1 block from the host tier
    prefix_host_bytes: Gauge          # bytes of blocks in the host tier
    prefix_host_capacity: Gauge       # bytes of the host tier (0 = none)
    kv_cache_tokens: Gauge            # [state] used (K/V written) | reserved (allocated) by running requests
    kv_cache_capacity: Gauge          # tokens of K/V the memory plan reserves (max_running x context)
    kv_cache_usage: Gauge             # reserved / capacity, 0..1 (vLLM's kv_cache_usage_perc)
    cgroup_memory: Gauge              # [kind] current | max
    engram_rows: Counter              # [phase] deepseek41 Engram table rows the tokens read
    engram_wait_seconds: Counter      # [phase] seconds compute waited for Engram rows from the store
    decode_guesses: Counter           # [outcome] decode's guessed next-layer experts on disk: hit | miss
    decode_guess_bytes: Counter       # [outcome] bytes read ahead for them: used | wasted
    flex_hits: Counter                # routed experts computed from a flex cache copy (worker/flex_cache.py)
    flex_slots: Gauge                 # [state] flex cache expert slots: allocated | used
    flex_bytes: Gauge                 # [state] flex cache bytes: allocated | room (the KV reservation not held)
    gc_pause: Histogram               # [generation] seconds each cyclic collection stalled the process (gc_pauses.py)


def make_worker_metrics(version: str = "0.1.0") -> WorkerMetrics:
    reg = _registry()
    m = WorkerMetrics(
        registry=reg,
        build_info=_build_info(reg, "worker", version),
        model_info=Info("betelgeuse_model", "The served model (value 1): name, arch, quant, geometry.", registry=reg),
        ready=Gauge("betelgeuse_ready", "1 when serving (model loaded, store attached), else 0.", registry=reg),
        prompt_tokens=Counter("betelgeuse_prompt_tokens", "Prompt tokens prefilled.", registry=reg),
        generation_tokens=Counter("betelgeuse_generation_tokens",
                                  "Tokens generated by decode passes (each request's first token comes from its prefill).",
                                  registry=reg),
        busy_seconds=Counter("betelgeuse_engine_busy_seconds", "Wall seconds the engine spent in each phase.",
                             ["phase"], registry=reg),
        ttft=Histogram("betelgeuse_time_to_first_token_seconds", "Time to first token.",
                       buckets=TTFT_BUCKETS, registry=reg),
        inter_token=Histogram("betelgeuse_inter_token_latency_seconds", "Time between consecutive tokens.",
                              buckets=ITL_BUCKETS, registry=reg),
        request_duration=Histogram("betelgeuse_request_duration_seconds", "End-to-end request latency.",
                                   buckets=E2E_BUCKETS, registry=reg),
        request_queue=Histogram("betelgeuse_request_queue_seconds", "Time a request waited in the queue.",
                                buckets=E2E_BUCKETS, registry=reg),
        request_prompt_tokens=Histogram("betelgeuse_request_prompt_tokens", "Prompt length per request.",
                                        buckets=TOKEN_BUCKETS, registry=reg),
        request_generation_tokens=Histogram("betelgeuse_request_generation_tokens",
                                            "Generated tokens per request.", buckets=TOKEN_BUCKETS, registry=reg),
        requests=Counter("betelgeuse_requests", "Finished RPCs by method and gRPC status code.",
                         ["method", "code"], registry=reg),
        requests_finished=Counter("betelgeuse_requests_finished", "Completed generations by finish reason.",
                                  ["finish_reason"], registry=reg),
        requests_running=Gauge("betelgeuse_requests_running", "Requests being computed.", registry=reg),
        requests_waiting=Gauge("betelgeuse_requests_waiting", "Requests in the queue.", registry=reg),
        expert_reads=Counter("betelgeuse_expert_reads", "Expert loads by the tier they were read from.",
                             ["tier", "phase"], registry=reg),
        disk_wait_seconds=Counter("betelgeuse_disk_wait_seconds",
                                  "Seconds compute stalled waiting for experts that were on disk.",
                                  ["phase"], registry=reg),
        h2d_bytes=Counter("betelgeuse_host_to_device_bytes", "Bytes copied host to device.", registry=reg),
        h2d_seconds=Counter("betelgeuse_host_to_device_seconds", "Seconds spent copying host to device.",
                            registry=reg),
        expert_slots=_expert_slots_gauge(reg),
        vram_used_bytes=Gauge("betelgeuse_vram_used_bytes", "VRAM in use by pool.", ["pool"], registry=reg),
        vram_budget_bytes=Gauge("betelgeuse_vram_budget_bytes", "The configured VRAM budget.", registry=reg),
        prefix_cache_queries=Counter("betelgeuse_prefix_cache_queries", "Prefix-cache lookups (one per prefilled "
                                     "request).", registry=reg),
        prefix_cache_hits=Counter("betelgeuse_prefix_cache_hits", "Lookups that reused at least one cached block.",
                                  registry=reg),
        prefix_cache_tokens=Counter("betelgeuse_prefix_cache_reused_tokens", "Prompt tokens served from the prefix "
                                    "cache instead of prefilled.", registry=reg),
        prefix_cache_evictions=Counter("betelgeuse_prefix_cache_evictions", "Prefix-cache blocks evicted (LRU).",
                                       registry=reg),
        prefix_cache_refused=Counter("betelgeuse_prefix_cache_refused", "Prefix-cache entries refused: a snapshot "
                                     "that did not fit the pool with every unheld entry evicted.", registry=reg),
        prefix_cache_bytes=Gauge("betelgeuse_prefix_cache_used_bytes", "Bytes of cached K/V blocks.", registry=reg),
        prefix_cache_capacity=Gauge("betelgeuse_prefix_cache_capacity_bytes", "Bytes of the prefix-cache pool "
                                    "(0 = off).", registry=reg),
        prefix_cache_usage=Gauge("betelgeuse_prefix_cache_usage_ratio", "Prefix-cache bytes used / capacity (0..1; 0 "
                                 "when off).", registry=reg),
        prefix_cache_held=Gauge("betelgeuse_prefix_cache_held_blocks", "Prefix-cache blocks (snapshots) held by "
                                "running requests: not evictable; 0 when idle (more is a leak).", registry=reg),
        prefix_host_hits=Counter("betelgeuse_prefix_host_hits", "Lookups that reused at least one block from the "
                                 "prefix cache's host tier.", registry=reg),
        prefix_host_bytes=Gauge("betelgeuse_prefix_host_used_bytes", "Bytes of K/V blocks in the prefix cache's host "
                                "tier (held by the store, kept across worker restarts).", registry=reg),
        prefix_host_capacity=Gauge("betelgeuse_prefix_host_capacity_bytes", "Bytes of the prefix cache's host tier "
                                   "(0 = none).", registry=reg),
        kv_cache_tokens=Gauge("betelgeuse_kv_cache_tokens", "K/V cache tokens of the running requests: state=used "
                              "(written) | reserved (allocated: prompt + max_tokens).", ["state"], registry=reg),
        kv_cache_capacity=Gauge("betelgeuse_kv_cache_capacity_tokens", "K/V cache tokens the memory plan reserves "
                                "(max_running x the context).", registry=reg),
        kv_cache_usage=Gauge("betelgeuse_kv_cache_usage_ratio", "Reserved K/V cache tokens / capacity (0..1).",
                             registry=reg),
        cgroup_memory=_cgroup_gauge(reg),
        engram_rows=Counter("betelgeuse_engram_rows", "Engram table rows read for the tokens (deepseek41).", ["phase"],
                            registry=reg),
        engram_wait_seconds=Counter("betelgeuse_engram_wait_seconds", "Seconds compute waited for Engram rows "
                                    "from the store (deepseek41).", ["phase"], registry=reg),
        decode_guesses=Counter("betelgeuse_decode_guesses", "Decode's guessed next-layer experts that were on disk, "
                               "by outcome: hit (the layer used it) | miss.", ["outcome"], registry=reg),
        decode_guess_bytes=Counter("betelgeuse_decode_guess_read_bytes", "Bytes read ahead for decode's guessed "
                                   "experts, by outcome: used | wasted (no load of their layer took them).",
                                   ["outcome"], registry=reg),
        flex_hits=Counter("betelgeuse_flex_cache_hits", "Routed experts computed from a copy in the flex cache (VRAM "
                          "reserved for sequences not running): a disk read or host copy saved each.", registry=reg),
        flex_slots=Gauge("betelgeuse_flex_cache_slots", "Flex cache expert slots: state=allocated | used.", ["state"],
                         registry=reg),
        flex_bytes=Gauge("betelgeuse_flex_cache_bytes", "Flex cache device bytes: state=allocated (its chunks now) | "
                         "room (the plan's KV reservation less what the running sequences' states and graphs take).",
                         ["state"], registry=reg),
        gc_pause=Histogram("betelgeuse_gc_pause_seconds", "Seconds each cyclic garbage collection of the worker "
                           "process stalled it, by generation (2: full).", ["generation"], buckets=GC_BUCKETS,
                           registry=reg),
    )
    for g in ("0", "1", "2"):                 # every generation's series from the start (rate() needs them)
        m.gc_pause.labels(g)
    for outcome in GUESS_OUTCOMES:
        m.decode_guesses.labels(outcome=outcome)
    for outcome in GUESS_BYTES:
        m.decode_guess_bytes.labels(outcome=outcome)
    for state in ("allocated", "used"):
        m.flex_slots.labels(state=state)
    for state in ("allocated", "room"):
        m.flex_bytes.labels(state=state)
    for phase in PHASES:
        m.busy_seconds.labels(phase=phase)
        m.disk_wait_seconds.labels(phase=phase)
        m.engram_rows.labels(phase=phase)
        m.engram_wait_seconds.labels(phase=phase)
        for tier in TIERS:
            m.expert_reads.labels(tier=tier, phase=phase)
    for method in RPC_METHODS:
        for code in RPC_CODES:
            m.requests.labels(method=method, code=code)
    for reason in FINISH_REASONS:
        m.requests_finished.labels(finish_reason=reason)
    for tier in ("vram", "staging"):
        for state in ("used", "free"):
            m.expert_slots.labels(tier=tier, state=state)
    for pool in ("dense_weights", "experts", "kv_cache", "workspace"):
        m.vram_used_bytes.labels(pool=pool)
    for state in ("used", "reserved"):
        m.kv_cache_tokens.labels(state=state)
    for kind in ("current", "max"):
        m.cgroup_memory.labels(kind=kind)
    return m


@dataclass(slots=True)
class StoreMetrics(_CgroupReader):
    registry: CollectorRegistry
    build_info: Info
    ready: Gauge                      # 1 once the arena is faulted in and the socket listens
    disk_read_bytes: Counter          # [reason] bytes read from the GGUF file (experts, Engram rows)
    disk_reads: Counter               # [reason] read requests issued (preadv calls)
    disk_read_duration: Histogram     # seconds per read request
    disk_active_seconds: Counter      # wall seconds with a read in flight (the disk busy; its rate's gap to 1: idle)
    disk_direct_io: Gauge             # 1 = O_DIRECT, 0 = buffered fallback + POSIX_FADV_DONTNEED
    expert_loads: Counter             # [reason] experts written into host slots
    expert_evictions: Counter         # experts dropped from host slots
    consolidations: Counter           # end-of-pass placement updates
    expert_slots: Gauge               # [tier, state] store tier: host
    arena_bytes: Gauge                # size of the memfd host-slot arena
    workers_attached: Gauge           # worker processes holding the arena
    cgroup_memory: Gauge              # [kind] current | max
    engram_rows: Counter              # [source] deepseek41 Engram rows served: disk | cache (the store's row cache)
    prefix_file_entries: Gauge        # prefix host tier entries the save file holds ([store] prefix_save_path)
    prefix_loaded_entries: Gauge      # of them, copied back into the host tier at start
    prefix_saved_bytes: Counter       # bytes the saves wrote (O_DIRECT)
    prefix_last_save: Gauge           # unix time of the last save that wrote something (0 = none)


def make_store_metrics(version: str = "0.1.0") -> StoreMetrics:
    reg = _registry()
    m = StoreMetrics(
        registry=reg,
        build_info=_build_info(reg, "store", version),
        ready=Gauge("betelgeuse_ready", "1 when serving (arena ready, socket listening), else 0.", registry=reg),
        disk_read_bytes=Counter("betelgeuse_disk_read_bytes", "Bytes read from disk.", ["reason"], registry=reg),
        disk_reads=Counter("betelgeuse_disk_reads", "Disk read requests.", ["reason"], registry=reg),
        disk_active_seconds=Counter("betelgeuse_disk_active_seconds",
                                    "Wall seconds with at least one disk read in flight (rate: the disk's busy "
                                    "share; 1 - rate: the share it stood idle).", registry=reg),
        disk_read_duration=Histogram("betelgeuse_disk_read_duration_seconds", "Latency of one disk read request.",
                                     buckets=DISK_READ_BUCKETS, registry=reg),
        disk_direct_io=Gauge("betelgeuse_disk_direct_io",
                             "1 if reads bypass the page cache (O_DIRECT), 0 on the buffered fallback.", registry=reg),
        expert_loads=Counter("betelgeuse_expert_loads", "Experts written into host slots.", ["reason"], registry=reg),
        expert_evictions=Counter("betelgeuse_expert_evictions", "Experts dropped from host slots.", registry=reg),
        consolidations=Counter("betelgeuse_consolidations", "End-of-pass slot placement updates.", registry=reg),
        expert_slots=_expert_slots_gauge(reg),
        arena_bytes=Gauge("betelgeuse_arena_bytes", "Size of the shared host-slot arena.", registry=reg),
        workers_attached=Gauge("betelgeuse_workers_attached", "Worker processes attached to the arena.",
                               registry=reg),
        cgroup_memory=_cgroup_gauge(reg),
        engram_rows=Counter("betelgeuse_engram_store_rows", "Engram rows the store served, by source (disk | cache).",
                            ["source"], registry=reg),
        prefix_file_entries=Gauge("betelgeuse_prefix_file_entries", "Prefix cache host-tier entries the save file "
                                  "holds.", registry=reg),
        prefix_loaded_entries=Gauge("betelgeuse_prefix_loaded_entries", "Prefix cache host-tier entries loaded from "
                                    "the save file at start.", registry=reg),
        prefix_saved_bytes=Counter("betelgeuse_prefix_saved_bytes", "Bytes written saving the prefix cache's host "
                                   "tier.", registry=reg),
        prefix_last_save=Gauge("betelgeuse_prefix_last_save_timestamp_seconds", "Unix time of the last save of the "
                               "prefix cache's host tier (0 = none).", registry=reg),
    )
    for source in ("disk", "cache"):
        m.engram_rows.labels(source=source)
    for reason in READ_REASONS:
        m.disk_read_bytes.labels(reason=reason)
        m.disk_reads.labels(reason=reason)
        m.expert_loads.labels(reason=reason)
    m.disk_read_bytes.labels(reason="engram")         # deepseek41's Engram rows (the store's own reader)
    m.disk_reads.labels(reason="engram")
    for state in ("used", "free"):
        m.expert_slots.labels(tier="host", state=state)
    for kind in ("current", "max"):
        m.cgroup_memory.labels(kind=kind)
    return m


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
    """Serve /metrics on a daemon thread; port 0 picks a free one. Returns (server, port).

    Stop with server.shutdown(); server.server_close().
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
