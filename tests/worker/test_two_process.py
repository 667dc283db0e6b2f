"""The two-process engine: a real store process (`python -m services.store_main`) and a worker
(this test process through GrpcStoreClient, or a real `services.worker_main` process).

- logits through the store process are bit-identical to the in-process `Qwen3MoeReference`, cold and
  after consolidation, and (one config) agree with Hugging Face transformers reading the same file;
- logits and a decode are the same bits on both session transports (store.session_transport grpc, seqpacket);
- the two processes are different pids mapping the same memfd (same inode in /proc/<pid>/maps);
- no expert bytes cross the control socket: the serialized gRPC bytes of a whole pass (counted by a
  client interceptor) and the bytes the store process wrote to any fd (/proc/<pid>/io wchar) are
  far below one expert, while the pass moved dozens of experts.
"""

from __future__ import annotations

import os

import pytest
import torch

from betelgeuse.config import EngineConfig
from betelgeuse.model.qwen3moe import Qwen3MoeReference
from betelgeuse.worker.runner import ModelRunner

from engine_helpers import (WIDE_SPEC, StoreSockets, arena_mappings, counting_store_client, free_port, generate,
                            hf_model, prompt, proc_io, qwen3_reference, settles, start_store, start_worker,
                            store_status, write_synth)

PROMPT = prompt(24, WIDE_SPEC["n_vocab"], seed=4)
VRAM, HOST = 2, 6          # of 16 experts: all three tiers in use after consolidation
REL_TOL = 1e-4             # same justification as tests/model/test_model_oracle.py


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("twoproc") / "wide.gguf", **WIDE_SPEC)


@pytest.fixture(scope="module")
def reference(wide):
    return qwen3_reference(wide, PROMPT)[1]


@pytest.fixture
def store(wide, tmp_path):
    socks = StoreSockets(tmp_path)
    p = start_store(wide, socks, VRAM, HOST)
    try:
        yield p, socks
    finally:
        p.stop()


def _inode(line: str) -> str:
    return line.split()[4]          # /proc/<pid>/maps: address perms offset dev inode path


def test_store_process_matches_reference_and_sends_no_expert_bytes(wide, reference, store):
    proc, socks = store
    client = counting_store_client(socks)
    runner = ModelRunner(EngineConfig(model_path=str(wide), vram_slots=VRAM, host_slots=HOST), client)
    try:
        # separate processes, one arena
        assert proc.pid != os.getpid()
        mine, theirs = arena_mappings(os.getpid()), arena_mappings(proc.pid)
        assert mine and theirs, (mine, theirs)
        assert {_inode(x) for x in mine} & {_inode(x) for x in theirs}, "not the same memfd"

        expert_bytes = runner.file.expert_nbytes(0)
        assert expert_bytes > 100_000
        results = []
        for name in ("cold", "consolidated", "repeat"):
            c0, r0, w0 = client.counter.total, client.counter.received, proc_io(proc.pid)["wchar"]
            logits, st = runner.forward(PROMPT, runner.new_cache(64), all_logits=True)
            control = client.counter.total - c0
            wchar = proc_io(proc.pid)["wchar"] - w0
            moved = sum(st.reads.values()) * expert_bytes        # expert bytes the pass used, any tier
            print(f"\n[two-process] {name}: reads {st.reads}, disk {st.disk_bytes} B, control socket "
                  f"{control} B serialized ({client.counter.received - r0} B replies), store wrote {wchar} B; "
                  f"one expert {expert_bytes} B, experts used {moved} B")
            assert torch.equal(logits, reference), f"{name}: max |diff| {(logits - reference).abs().max():.3e}"
            assert control < expert_bytes / 20, (control, expert_bytes)
            assert wchar < expert_bytes / 10, (wchar, expert_bytes)
            assert control < moved / 1000
            results.append(st)
            runner.settle()
        cold, _, cons = results
        assert cold.reads["disk"] == sum(cold.reads.values()) and cold.disk_bytes >= cold.reads["disk"] * expert_bytes
        assert cons.reads["vram"] > 0 and cons.reads["host"] > 0 and cons.reads["disk"] > 0, cons.reads
        st = client.status()
        assert st["pid"] == proc.pid and st["disk_bytes"] > 0
    finally:
        runner.close()
        client.close()


def test_logits_are_the_same_bits_on_both_session_transports(wide, reference, store):
    """The session stream on gRPC and on SOCK_SEQPACKET (store.session_transport; the latter also with
    store.session_reader "caller": no reader thread, and "spin": the caller busy-polling): a cold pass, a consolidated
    one and a short decode through the same store process give the reference's logits, and the same bits on all four."""
    _, socks = store
    outs = {}
    for transport in ("seqpacket", "grpc", "seqpacket+caller", "seqpacket+spin"):
        client = counting_store_client(socks, transport.partition("+")[0])
        client.session_reader = transport.partition("+")[2] or "thread"    # before the stream opens
        runner = ModelRunner(EngineConfig(model_path=str(wide), vram_slots=VRAM, host_slots=HOST), client)
        try:
            rows = []
            for _ in range(2):                              # cold, then consolidated
                logits, _st = runner.forward(PROMPT, runner.new_cache(64), all_logits=True)
                assert torch.equal(logits, reference), (transport, (logits - reference).abs().max())
                rows.append(logits)
                runner.settle()
            kv = runner.new_cache(64)
            lg, _ = runner.forward(PROMPT, kv)
            for _ in range(4):
                lg, _st = runner.forward([int(lg[-1].argmax())], kv, consolidate=False)
                rows.append(lg)
            outs[transport] = torch.cat(rows)
            if transport != "grpc":                         # the session's messages did not go over gRPC
                assert type(client._stream).__name__ == "_SeqStream", client._stream
                assert client._stream.caller == ("+" in transport), transport
                assert bool(client._stream.spin_s) == transport.endswith("+spin"), transport
        finally:
            runner.close()
            client.close()
    for transport in ("seqpacket", "seqpacket+caller", "seqpacket+spin"):
        assert torch.equal(outs[transport], outs["grpc"]), transport


@pytest.mark.parametrize("transport", ["grpc", "seqpacket"])
def test_decode_guesses_through_the_store_process(wide, store, transport):
    """Decode's guessed reads ahead (worker/guess.py) over gRPC, where the Prefetch call is not waited for, 3 layers
    ahead and 1: the reads start (counted from the store's answers) and the decoded logits are the bits of the same
    decode without them."""
    _, socks = store
    outs = {}
    for depth in (3, 1, 0):            # guesses first: staged copies left by a run are not read again
        client = counting_store_client(socks, transport)
        runner = ModelRunner(EngineConfig(model_path=str(wide), vram_slots=VRAM, host_slots=HOST,
                                          prefetch_decode=depth > 0, prefetch_depth=max(depth, 1)), client)
        try:
            kv = runner.new_cache(64)
            lg, _ = runner.forward(PROMPT, kv)
            runner.settle()
            rows, stats = [], []
            for _ in range(6):
                lg, st = runner.forward([int(lg[-1].argmax())], kv, consolidate=False)
                rows.append(lg)
                stats.append(st)
            outs[depth] = torch.cat(rows)
            if depth == 3:
                assert sum(s.guessed for s in stats) > 0 and sum(s.prefetched for s in stats) > 0
            elif depth:
                assert sum(s.guessed for s in stats) > 0     # its reads may find the first run's staged copies
            else:
                assert sum(s.guessed + s.prefetched for s in stats) == 0
        finally:
            runner.close()
            client.close()
    assert torch.equal(outs[3], outs[0]) and torch.equal(outs[1], outs[0])


def _seq_connections(path: str) -> int:
    """Connected SOCK_SEQPACKET sockets bound to `path` (/proc/net/unix: the store's end of each session stream)."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if len(r) == 8 and r[7] == path and r[4] == "0005" and r[5] == "03")


@pytest.mark.parametrize("transport", ["grpc", "seqpacket"])
def test_worker_process_serves_reference_tokens(wide, reference, store, tmp_path, monkeypatch, transport):
    """A real worker process: its own pid, the store's memfd in its maps, greedy tokens as the reference; its session
    stream on store.session_transport (set by its environment variable: the store's SEQPACKET socket has a
    connection with seqpacket, none with grpc)."""
    proc, socks = store
    monkeypatch.setenv("BETELGEUSE_STORE_SESSION_TRANSPORT", transport)
    ref = Qwen3MoeReference.load(wide)
    kv = ref.new_cache(64)
    want = []
    with torch.no_grad():
        logits = ref.forward(torch.tensor(PROMPT), kv)[-1]
        for _ in range(5):
            want.append(int(logits.argmax()))
            logits = ref.forward(torch.tensor(want[-1:]), kv)[-1]
    port = free_port()
    worker = start_worker(wide, socks, port, VRAM, HOST)
    try:
        assert len({os.getpid(), proc.pid, worker.pid}) == 3
        w, s = arena_mappings(worker.pid), arena_mappings(proc.pid)
        assert w and s and {_inode(x) for x in w} & {_inode(x) for x in s}
        for i in range(2):                                  # cold, then warm after consolidation
            final = generate(port, PROMPT, max_tokens=5)
            assert list(final.token_ids) == want, (i, list(final.token_ids), want)
        assert final.usage.expert_reads_vram + final.usage.expert_reads_host > 0
        assert _seq_connections(socks.control + ".seq") == (transport == "seqpacket"), transport
    finally:
        assert worker.stop() == 0, worker.log()


def test_store_process_matches_transformers(oracle_models, tmp_path):
    """One configuration against the independent oracle: the F32 oracle model, 2 VRAM + 3 host of 8."""
    from conftest import ORACLE_OVERRIDES
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = oracle_models["F32"]
    ids = prompt(16, ORACLE_OVERRIDES["n_vocab"], seed=9)
    with torch.no_grad():
        want = hf_model(path, ORACLE_OVERRIDES["n_ff_exp"])(torch.tensor([ids])).logits[0].float()
    socks = StoreSockets(tmp_path)
    proc = start_store(path, socks, 2, 3)
    client = counting_store_client(socks)
    runner = ModelRunner(EngineConfig(model_path=str(path), vram_slots=2, host_slots=3), client)
    try:
        for _ in range(2):
            got, st = runner.forward(ids, runner.new_cache(32), all_logits=True)
            runner.settle()
            scale = want.abs().max().item()
            diff = (got - want).abs().max().item()
            print(f"\n[two-process] vs transformers: max |diff| {diff:.3e} (tolerance {REL_TOL * scale:.3e}), reads {st.reads}")
            assert scale > 0.5 and diff <= REL_TOL * scale
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    finally:
        runner.close()
        client.close()
        proc.stop()


def test_an_idle_worker_holds_no_staging_slot(wide, store, tmp_path):
    """Every staging slot a real worker process was handed goes back: after decode-heavy requests (guesses read ahead,
    their unused ones dropped on Prefetch calls whose answer nobody waits for), the idle worker holds none in the
    store's books. gRPC cancels a call whose future is garbage-collected in flight, and the slots riding on it were
    lost: they accumulated request by request until every load waited for a slot that never came back (a live
    `serve` failed requests with "expert store unavailable (DEADLINE_EXCEEDED)")."""
    _, socks = store
    port = free_port()
    worker = start_worker(wide, socks, port, VRAM, HOST)
    try:
        for i in range(3):
            generate(port, prompt(32, WIDE_SPEC["n_vocab"], seed=7), max_tokens=40)
            assert settles(lambda: store_status(socks.control)["staging_handed"] == 0, timeout=5.0), \
                (i, store_status(socks.control)["staging_handed"])
        assert store_status(socks.control)["staging_reclaimed"] == 0      # every pass handed its slots back itself
    finally:
        assert worker.stop() == 0, worker.log()


def test_a_deepseek41_prompt_after_kill_9_of_the_worker_comes_from_the_host_tier(tmp_path):
    """The snapshot cache's host tier (worker/snapshot_host.py) lives in the store process: a worker killed with
    SIGKILL and started again answers the repeated prompt from it (every token cached, no pass) with the same tokens,
    and resumes a longer prompt at the first one's checkpoint (the bits of a miss: tests/worker/test_snapshot_cache.py);
    a worker with another routing mode starts the tier afresh."""
    from dataclasses import replace
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    model = tmp_path / "ds41-tiny.gguf"
    write_model(model, replace(spec_from_preset("ds41-tiny"), expert_qtype="Q8_0", seed=2), progress=False)
    P = prompt(150, 512, seed=5)
    chunk = ("--prefill-chunk", "64")         # P's checkpoint at 128 (deepseek41's default chunk, 256, would keep none)
    socks = StoreSockets(tmp_path)
    store = start_store(model, socks, 2, 4)
    try:
        port = free_port()
        worker = start_worker(model, socks, port, 2, 4, extra=chunk)
        first = generate(port, P)
        assert first.usage.cached_tokens == 0
        worker.kill9()
        worker = start_worker(model, socks, port, 2, 4, extra=chunk)
        try:
            again = generate(port, P)
            assert list(again.token_ids) == list(first.token_ids) and again.usage.cached_tokens == len(P)
            ext = generate(port, P + P[:40])
            assert ext.usage.cached_tokens == 128
            # a worker started with other numerics (an approximate routing mode) never adopts the tier: its entries
            # hold exact routing's bits
            worker.kill9()
            worker = start_worker(model, socks, port, 2, 4, extra=(*chunk, "--routing", "pool"))
            assert generate(port, P).usage.cached_tokens == 0
        finally:
            assert worker.stop() == 0, worker.log()
    finally:
        store.stop()


@pytest.mark.parametrize("transport", ["grpc", "seqpacket"])
def test_a_pass_failing_mid_layer_leaves_no_staging_slot_lost(wide, reference, store, transport):
    """A pass that fails mid-layer (a kernel raising: the device out of memory, say; the engine fails that pass's
    requests and goes on, invariant 7) drops its Load stream with experts still coming and the staging slots of
    the landed ones it held: the store had handed them to the worker, which no longer knows them. Each such failure
    lost slots for good, until every load waited for one that never came back (a live service failing every
    request with "expert store unavailable (DEADLINE_EXCEEDED)"). Between passes the worker holds none, so the
    store takes back what is still handed when a pass ends or begins: after the failure and one good pass, none is
    handed, and the next passes give the reference logits."""
    _, socks = store
    client = counting_store_client(socks, transport)
    runner = ModelRunner(EngineConfig(model_path=str(wide), vram_slots=VRAM, host_slots=HOST), client)
    apply, calls = runner.moe._apply, []

    def failing(*a, **kw):                 # the third expert group of the cold pass fails (layer 0's disk misses)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: a kernel failed mid-layer")
        return apply(*a, **kw)
    try:
        runner.moe._apply = failing
        with pytest.raises(RuntimeError, match="injected"):
            runner.forward(PROMPT, runner.new_cache(64), all_logits=True)
        runner.moe._apply = apply
        for i in range(2):
            logits, _ = runner.forward(PROMPT, runner.new_cache(64), all_logits=True)
            runner.settle()
            assert torch.equal(logits, reference), i
            assert settles(lambda: store_status(socks.control)["staging_handed"] == 0, timeout=5.0), \
                (i, store_status(socks.control)["staging_handed"])
        assert store_status(socks.control)["staging_reclaimed"] > 0
    finally:
        runner.close()
        client.close()
