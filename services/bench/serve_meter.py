"""The serve suite's bound: what the live service moved in a measured phase, against rates measured in the same run.

A phase (the lone prompt, N clients released together) is bracketed by two snapshots of the service's own counters,
and a third is taken the moment the decode window opens (the first token of the last client: every prompt of the
phase has been prefilled by then, so from there to the end only decode passes run):

  worker  GET /metrics on the HTTP port: betelgeuse_generation_tokens (tokens of decode passes),
          betelgeuse_prompt_tokens, betelgeuse_host_to_device_bytes / _seconds, betelgeuse_engine_busy_seconds{phase},
          betelgeuse_disk_wait_seconds{phase}; each pass is counted when it ends; the flex expert cache's hits and
          (gauges, at the snapshot) its bytes beside the running sequences' states' (betelgeuse_flex_cache_bytes,
          betelgeuse_vram_used_bytes{pool="kv_cache"}): a decode window's are those with every client running
  store   its Status RPC on the control socket: disk_bytes = device bytes read (O_DIRECT, 4 KiB rounding included),
          counted as each read completes; read at the call (its /metrics copies the same counter only every 0.5 s);
          disk_active_seconds = wall seconds with a read in flight (a window's disk busy share = its delta / the
          window's seconds: what the disk stood idle is 1 minus it)

A window's bound (tok/s) = tokens / max(disk bytes / disk rate, H2D bytes / H2D rate): the rate no schedule could beat
with what it actually moved, if disk and copies overlapped perfectly with everything else. The disk is the store's
reader on whole experts of the model file, sampled in both ways the store's loads read (ceilings.measure_disk:
"random", batches of random experts each waited for, as decode's few per layer; "layer", whole layers' experts in file
order with the reader's queue kept full, as a prefill's), a sample's rate being the faster of the two (disk_rate:
max(random, layer)): a window holds reads of either kind, and a ceiling must hold for every pattern in it, so no pass
beats its bound by the way it reads. The device's disk drifts within a run (1.1-2.1 GB/s), so the disk is sampled
before the first serve and again right beside every phase (serve.ServeSuite._beside: once the store's disk counter
stands still, before the phase, and after the case's last one), and each window is bounded at the fastest rate
observed around it (window_disk_rate): the sample before its phase, the one after it (the next phase's), the run's
first, and its own reads (its disk bytes over its seconds with a read in flight). The H2D rate is a pinned
copy (a memfd arena registered with cudaHostRegister, as the worker's) to the GPU, measured by the bench on the same device before
the first serve; on the CPU there is no H2D rate (n/a) and the disk alone bounds.

The prefill window (the phase's start -> the decode window opens) bounds the phase's time to first token: its
TTFT bound (s) = max(disk bytes / disk rate, H2D bytes / H2D rate, the prefill passes' work), the work being the
engine's prefill busy seconds less the seconds they stood waiting for disk (what the passes would still take with the
disk infinitely fast). It counts every byte the disk read in the window (the prefill's demand reads, its read-ahead,
any idle fills still landing), once however many requests shared the pass, and only the pass's own work: not the
HTTP round trip, the admission window's hold or the tokenizer. Achieved = the TTFT bound / the measured TTFT (of the
window's last first token). With every prompt of a burst in one joint pass (worker/scheduler.py) all first tokens
wait for the whole window, so the burst's bound over a lone prompt's is the floor of the TTFT ratio at that disk
(for that schedule; docs/architecture.md says why no other gets under 2x on the bench geometry).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from betelgeuse.errors import BetelgeuseError

GB = 1e9
BOUND_WRONG = 1.02          # achieved above this (timer noise allowed) means the bound was not a bound


@dataclass(slots=True)
class Snapshot:
    t: float                    # perf_counter when the scrape began (the client's clock)
    generation_tokens: float    # decode passes' tokens (a request's first token comes from its prefill)
    prompt_tokens: float        # tokens prefilled
    h2d_bytes: float
    h2d_seconds: float          # the copy stream's busy seconds
    busy_s: dict = field(default_factory=dict)        # phase -> engine wall seconds
    disk_wait_s: dict = field(default_factory=dict)   # phase -> seconds compute stalled on disk-resident experts
    disk_bytes: int = 0         # the store's device bytes read
    disk_active_s: float = 0.0  # the store's wall seconds with a read in flight
    readahead_bytes: int = 0    # the store's bytes read ahead that landed ...
    readahead_used: int = 0     # ... and of them those a load took (the rest: read ahead, unused)
    flex_hits: float = 0.0      # routed experts computed from a flex cache copy
    flex_bytes: float = 0.0     # the flex cache's device bytes at the snapshot
    kv_bytes: float = 0.0       # the running sequences' states' device bytes at the snapshot


def parse_metrics(text: str) -> dict:
    """{(sample name, ((label, value), ...)): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    if key not in m:
        raise BetelgeuseError(f"the worker's /metrics has no {name}{labels or ''}")
    return m[key]


class Meter:
    """Snapshots of one serve's counters: the worker's /metrics through `client` (serve.Client), the store's Status
    over `store_socket`. mark() takes one on a thread of its own (the caller is a client reading its stream)."""

    def __init__(self, client, store_socket: str):
        import grpc
        from services.pb.betelgeuse.v1 import store_pb2, store_pb2_grpc
        self.client = client
        self._channel = grpc.insecure_channel(f"unix:{store_socket}")
        self._status = store_pb2_grpc.ExpertStoreStub(self._channel).Status
        self._request = store_pb2.StatusRequest()
        self._marked: list = []
        self._threads: list[threading.Thread] = []

    def store_status(self) -> dict:
        """The store's Status RPC (its JSON: disk_bytes, disk_active_seconds, ...)."""
        import json

        import grpc
        try:
            return json.loads(self._status(self._request, timeout=5).json)
        except grpc.RpcError as e:
            raise BetelgeuseError(f"the store's Status: {e.code().name}: {e.details()}") from None

    def wait_idle(self, quiet_s: float, most_s: float, poll_s: float = 0.05) -> tuple[float, bool]:
        """Wait until the store's disk bytes counter has stood still for quiet_s (a phase's consolidation fills can
        run on after its last token), at most most_s: (seconds waited, whether it stood still). A disk sample taken
        then does not share the disk with the service's reads."""
        t0 = time.monotonic()
        last, since = self.store_status()["disk_bytes"], t0
        while True:
            now = time.monotonic()
            if now - since >= quiet_s:
                return now - t0, True
            if now - t0 >= most_s:
                return now - t0, False
            time.sleep(poll_s)
            x = self.store_status()["disk_bytes"]
            if x != last:
                last, since = x, time.monotonic()

    def snapshot(self) -> Snapshot:
        t = time.perf_counter()
        # the store's counters first: a mark taken as the decode window opens then has the fewest of the first
        # decode step's reads in its prefill window (the worker's scrape takes longer)
        st = self.store_status()
        status, body = self.client.get("/metrics")
        if status != 200 or not isinstance(body, str):
            raise BetelgeuseError(f"GET /metrics answered {status}: {str(body)[:200]}")
        m = parse_metrics(body)
        phases = ("prefill", "decode")
        return Snapshot(t, _get(m, "betelgeuse_generation_tokens_total"), _get(m, "betelgeuse_prompt_tokens_total"),
                        _get(m, "betelgeuse_host_to_device_bytes_total"),
                        _get(m, "betelgeuse_host_to_device_seconds_total"),
                        {p: _get(m, "betelgeuse_engine_busy_seconds_total", phase=p) for p in phases},
                        {p: _get(m, "betelgeuse_disk_wait_seconds_total", phase=p) for p in phases},
                        int(st["disk_bytes"]), float(st.get("disk_active_seconds", 0.0)),
                        int(st.get("readahead_bytes", 0)), int(st.get("readahead_used", 0)),
                        m.get(("betelgeuse_flex_cache_hits_total", ()), 0.0),
                        m.get(("betelgeuse_flex_cache_bytes", (("state", "allocated"),)), 0.0),
                        m.get(("betelgeuse_vram_used_bytes", (("pool", "kv_cache"),)), 0.0))

    def mark(self):
        """A snapshot now, on a thread of its own (read with marked() once the phase is over)."""
        def run():
            try:
                self._marked.append(self.snapshot())
            except BetelgeuseError as e:
                self._marked.append(e)
        t = threading.Thread(target=run, name="serve-meter", daemon=True)
        self._threads.append(t)
        t.start()

    def marked(self) -> Snapshot | None:
        """The first mark() since the last call (None: none, or it failed), all marks' threads joined."""
        for t in self._threads:
            t.join(30)
        got, self._marked, self._threads = self._marked, [], []
        return got[0] if got and isinstance(got[0], Snapshot) else None

    def close(self):
        self._channel.close()


DISK_PATTERNS = ("random", "layer")      # ceilings.measure_disk's ways of reading


def disk_rates(disk: dict) -> dict[str, float]:
    """{pattern: bytes/s} of a run's disk record (ceilings.measure_disk_rates: one sample per pattern)."""
    return {p: disk[p]["bps"] for p in DISK_PATTERNS if isinstance(disk.get(p), dict)}


def disk_rate(rates: dict[str, float]) -> tuple[float, str]:
    """(bytes/s, pattern) every disk bound uses: the fastest of the patterns sampled, max(random, layer). A window
    holds reads of both kinds (a prefill's layer runs, decode's few experts per layer) and a ceiling must hold for
    every pattern it contains, so no pass can beat its bound by the way it reads."""
    if not rates:
        return 0.0, "none"
    pattern = max(rates, key=lambda p: rates[p] or 0.0)
    return rates[pattern] or 0.0, pattern


BESIDE = ("sample before", "sample after", "the run's first sample")    # a phase's disk samples (ServeSuite._beside)
OWN_READS = "the window's own reads"


def case_disk_rate(samples: list[float], own_bytes: int = 0, own_busy_s: float = 0.0, threads: int = 1,
                   labels: tuple = ("sample before", "sample after"),
                   own_label: str = "the pass's own reads") -> tuple[float, str]:
    """(bytes/s, where it came from) of the disk for one pass or window: the fastest of the samples taken beside it
    (labels[i] names samples[i]; the passes suite: before and after its case) and its own reads (own_bytes over
    own_busy_s x threads: the passes suite gives the reader threads' summed time in preadv, the serve suite the wall
    seconds with a read in flight and threads=1; either way at least the rate the disk ran at while it read). A bound
    must hold, so it takes the fastest rate observed around the reads it bounds."""
    best, src = 0.0, "none"
    for i, bps in enumerate(samples):
        if bps and bps > best:
            best, src = bps, labels[min(i, len(labels) - 1)]
    own = own_bytes * max(threads, 1) / own_busy_s if own_busy_s > 0 and own_bytes > 0 else 0.0
    if own > best:
        best, src = own, own_label
    return best, src


def window_disk_rate(a: Snapshot, b: Snapshot, samples: list[tuple[str, dict[str, float]]]) -> dict:
    """The disk rate the window a -> b is bounded at: the fastest of its phase's samples (each sample's disk_rate,
    max(random, layer); samples: [(label, {pattern: bytes/s})], BESIDE's labels) and the window's own reads (its disk
    bytes over its seconds with a read in flight: the rate the disk demonstrably ran at in it) (case_disk_rate).
    {"bps", "source" (the label or OWN_READS), "pattern" (the sample's, "own" for its own reads), "own_bps"}."""
    per = [(label, *disk_rate(rates)) for label, rates in samples]
    own_bytes, own_s = b.disk_bytes - a.disk_bytes, b.disk_active_s - a.disk_active_s
    bps, src = case_disk_rate([x[1] for x in per], own_bytes, own_s, 1, labels=tuple(x[0] for x in per) or ("-",),
                              own_label=OWN_READS)
    pattern = "own" if src == OWN_READS else next((p for label, _, p in per if label == src), "none")
    return {"bps": bps, "source": src, "pattern": pattern,
            "own_bps": own_bytes / own_s if own_s > 0 and own_bytes > 0 else None}


def window(a: Snapshot, b: Snapshot, disk_bps: float, h2d_bps: float | None, tokens: float | None = None) -> dict:
    """What moved from a to b and the bound it sets: tokens (default: the decode passes' tokens between them) over
    the longer of disk bytes / disk_bps and H2D bytes / h2d_bps (None: no H2D rate, the disk alone)."""
    tokens = b.generation_tokens - a.generation_tokens if tokens is None else tokens
    disk, h2d = b.disk_bytes - a.disk_bytes, b.h2d_bytes - a.h2d_bytes
    secs = {"disk": disk / disk_bps if disk_bps else None, "h2d": h2d / h2d_bps if h2d_bps else None}
    parts = {k: v for k, v in secs.items() if v is not None}
    limiter = max(parts, key=parts.get) if parts and max(parts.values()) > 0 else None
    return {"tokens": tokens, "seconds": b.t - a.t, "disk_bytes": disk, "h2d_bytes": h2d,
            "disk_bytes_per_token": disk / tokens if tokens else None,
            "h2d_bytes_per_token": h2d / tokens if tokens else None,
            "disk_s": secs["disk"], "h2d_s": secs["h2d"], "disk_bps": disk_bps, "h2d_bps": h2d_bps,
            "limiter": limiter, "bound_tps": tokens / parts[limiter] if limiter and tokens else None,
            "prefill_tokens": b.prompt_tokens - a.prompt_tokens,
            "decode_tokens": b.generation_tokens - a.generation_tokens,
            "busy_s": {p: b.busy_s[p] - a.busy_s.get(p, 0.0) for p in b.busy_s},
            "disk_wait_s": {p: b.disk_wait_s[p] - a.disk_wait_s.get(p, 0.0) for p in b.disk_wait_s},
            "h2d_busy_s": b.h2d_seconds - a.h2d_seconds,
            "disk_active_s": b.disk_active_s - a.disk_active_s,
            "disk_busy_fraction": (b.disk_active_s - a.disk_active_s) / (b.t - a.t) if b.t > a.t else None,
            "readahead_bytes": b.readahead_bytes - a.readahead_bytes,
            "readahead_unused_bytes": (b.readahead_bytes - a.readahead_bytes) - (b.readahead_used - a.readahead_used),
            "flex_hits": b.flex_hits - a.flex_hits, "flex_bytes": a.flex_bytes, "kv_bytes": a.kv_bytes}


def prefill_window(a: Snapshot, opened: Snapshot, disk_bps: float, h2d_bps: float | None,
                   ttft_s: float | None) -> dict:
    """The prefill window (a -> the decode window opened) and the TTFT bound it sets (module doc): window()'s
    fields over the prompt tokens prefilled, plus work_s (prefill busy less its disk wait), ttft_bound_s = the longest
    of disk_s, h2d_s and work_s, its ttft_limiter, ttft_s (measured: the window's last first token) and achieved =
    ttft_bound_s / ttft_s."""
    w = window(a, opened, disk_bps, h2d_bps, tokens=opened.prompt_tokens - a.prompt_tokens)
    work = max(0.0, w["busy_s"].get("prefill", 0.0) - w["disk_wait_s"].get("prefill", 0.0))
    parts = {k: v for k, v in (("disk", w["disk_s"]), ("h2d", w["h2d_s"]), ("work", work)) if v}
    limiter = max(parts, key=parts.get) if parts else None
    bound = parts[limiter] if limiter else None
    w.update(work_s=work, ttft_bound_s=bound, ttft_limiter=limiter, ttft_s=ttft_s, achieved=_over(bound, ttft_s))
    return w


def bounds(a: Snapshot, opened: Snapshot | None, b: Snapshot, disk: dict | list, h2d_bps: float | None,
           completion_tokens: int, decode_tps: float | None, end_to_end_tps: float | None,
           ttft_s: float | None = None) -> dict:
    """A phase's three windows: "prefill" (the phase's start -> the decode window opened, its TTFT bound against
    ttft_s, the last first token's TTFT: prefill_window), "decode" (the decode window opened -> the end, against the
    clients' decode rate) and "phase" (the whole phase, prefill included, its completion tokens against the
    end-to-end rate); achieved = the rate / its bound (prefill: the TTFT bound / the TTFT). disk: the disk samples
    beside the phase, [(label, {pattern: bytes/s})] (BESIDE: before it, after it, the run's first), or one sample's
    {pattern: bytes/s}; each window is bounded at window_disk_rate's (the fastest of them and of its own reads),
    recorded as disk_bps, disk_source, disk_pattern, disk_own_bps."""
    samples = [("sample", disk)] if isinstance(disk, dict) else list(disk)

    def at(x, y):
        return window_disk_rate(x, y, samples)
    rates = {"phase": at(a, b)}
    out = {"phase": window(a, b, rates["phase"]["bps"], h2d_bps, tokens=completion_tokens)}
    out["phase"]["achieved"] = _over(end_to_end_tps, out["phase"]["bound_tps"])
    if opened is not None:
        rates["prefill"], rates["decode"] = at(a, opened), at(opened, b)
        out["prefill"] = prefill_window(a, opened, rates["prefill"]["bps"], h2d_bps, ttft_s)
        out["decode"] = window(opened, b, rates["decode"]["bps"], h2d_bps)
        out["decode"]["achieved"] = _over(decode_tps, out["decode"]["bound_tps"])
        if out["decode"]["decode_tokens"] == 0 and completion_tokens:
            # the opening scrape (a thread started at the last first token, then two round trips) came back after
            # the service had counted every token of the phase: a short decode (a toy model's few tokens) can end
            # first. No decode pass lies in the window, so it bounds nothing; said, never a zero-token bound
            out["decode"]["empty"] = EMPTY
    for name, w in out.items():
        r = rates[name]
        w.update(disk_source=r["source"], disk_pattern=r["pattern"], disk_own_bps=r["own_bps"])
    return out


EMPTY = "empty: the service had decoded every token before the window's opening scrape returned"


def _over(a, b):
    return a / b if a is not None and b else None


def size(x: float | None) -> str:
    """Bytes for a table: GB, MB or kB (SI), three significant figures."""
    if x is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def disk_used(w: dict) -> str:
    """The disk rate a window's bound used and where it came from: "disk at 1.52 GB/s from the sample after (layer)"."""
    if not w.get("disk_bps"):
        return "no disk rate"
    src, pattern = w.get("disk_source", "?"), w.get("disk_pattern")
    where = ("the " if src.startswith("sample") else "") + src + (
        f" ({pattern})" if pattern not in (None, "own", "none") else "")
    return f"disk at {w['disk_bps'] / GB:.2f} GB/s from {where}"


def describe(w: dict | None) -> str:
    """One window as the tables print it: bound (limiter), achieved, the disk's busy share, the disk and H2D bytes
    it moved."""
    if not w:
        return "bound –"
    if w.get("empty"):
        return w["empty"]
    busy = w.get("disk_busy_fraction")
    ahead = w.get("readahead_bytes")
    moved = (f"disk {size(w['disk_bytes'])}" + ("" if busy is None else f" (busy {busy:.0%})")
             + ("" if not ahead else f", read ahead {size(ahead)} (unused {size(w['readahead_unused_bytes'])})")
             + f", H2D {size(w['h2d_bytes'])}"
             + ("" if not (w.get("flex_bytes") or w.get("flex_hits")) else
                f", flex {size(w['flex_bytes'])} beside KV {size(w['kv_bytes'])} ({w['flex_hits']:.0f} hits)"))
    if w.get("bound_tps") is None:
        why = "nothing read from disk" + ("" if w.get("h2d_bps") else ", no H2D rate")
        return f"bound none ({why}); {moved}"
    a = w.get("achieved")
    ach = "–" if a is None else f"{a:.2f}" if a >= 0.1 else f"{a:.2g}"
    rate = disk_used(w) if w["limiter"] == "disk" else f"{w['limiter']}; {disk_used(w)}"
    return f"bound {w['bound_tps']:.1f} ({rate}), achieved {ach}; {moved}"


def describe_prefill(w: dict | None) -> str:
    """A prefill window as the tables print it: the TTFT bound (its limiter, each term), achieved, what moved."""
    if not w:
        return "bound –"
    terms = ", ".join(f"{k} {w[k + '_s']:.2f} s" + (f" {disk_used(w)[5:]}" if k == "disk" else "")
                      for k in ("disk", "h2d", "work") if w.get(k + "_s") is not None)
    a = w.get("achieved")
    ach = "–" if a is None else f"{a:.2f}"
    b = w.get("ttft_bound_s")
    head = "TTFT bound –" if b is None else f"TTFT bound {b:.2f} s ({w['ttft_limiter']}; {terms})"
    moved = (f"disk {size(w['disk_bytes'])}" + ("" if w.get("disk_busy_fraction") is None else
                                                 f" (busy {w['disk_busy_fraction']:.0%})")
             + f", H2D {size(w['h2d_bytes'])}")
    return f"{head}, achieved {ach} of TTFT {w['ttft_s']:.2f} s; {moved}" if w.get("ttft_s") is not None else \
        f"{head}; {moved}"
