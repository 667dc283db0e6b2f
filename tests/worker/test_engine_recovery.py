"""Crash recovery with real processes (ended by the PIDs we started, nothing else).

- kill -9 of the worker: the store keeps the arena; a new worker re-attaches and a repeated prompt
  reads nothing from disk (store status disk_bytes unchanged), with every expert it needs resident
  (16 experts, 4 VRAM + 12 host slots) and the same greedy tokens.
- kill -9 of the store: the worker answers Generate with UNAVAILABLE and its health goes NOT_SERVING;
  when a new store starts on the same sockets it re-attaches by itself, health is SERVING again and a
  Generate succeeds with the same tokens.
"""

from __future__ import annotations

import time

import grpc
import pytest

from engine_helpers import (WIDE_SPEC, StoreSockets, free_port, generate, health, prompt, start_store,
                            start_worker, store_status, wait_health, write_synth)

PROMPT = prompt(24, WIDE_SPEC["n_vocab"], seed=8)
N_TOKENS = 3


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("recovery") / "wide.gguf", **WIDE_SPEC)


def _settled_status(sock: str, quiet: float = 0.6, timeout: float = 20.0) -> dict:
    """Store status once disk reads (a consolidation after a request) have stopped for `quiet` s."""
    t0 = time.monotonic()
    last = store_status(sock)
    while time.monotonic() - t0 < timeout:
        time.sleep(quiet)
        st = store_status(sock)
        if st["disk_bytes"] == last["disk_bytes"] and st["consolidations"] == last["consolidations"] \
                and not st["pass_active"]:
            return st
        last = st
    raise AssertionError(f"store kept reading for {timeout} s: {last}")


@pytest.mark.slow
def test_worker_kill9_reattaches_to_a_warm_store(wide, tmp_path):
    socks = StoreSockets(tmp_path)
    store = start_store(wide, socks, 4, 12)
    port = free_port()
    workers = [start_worker(wide, socks, port, 4, 12)]
    try:
        tokens = list(generate(port, PROMPT, N_TOKENS).token_ids)
        for _ in range(4):                  # until every expert the request needs is resident
            final = generate(port, PROMPT, N_TOKENS)
            assert list(final.token_ids) == tokens
            if final.usage.expert_reads_disk == 0:
                break
        assert final.usage.expert_reads_disk == 0, final.usage
        before = _settled_status(socks.control)

        old = workers[0]
        assert old.kill9() == -9
        workers.append(start_worker(wide, socks, port, 4, 12))
        final = generate(port, PROMPT, N_TOKENS)
        after = _settled_status(socks.control)
        print(f"\n[recovery] new worker pid {workers[-1].pid}: reads vram {final.usage.expert_reads_vram} "
              f"host {final.usage.expert_reads_host} disk {final.usage.expert_reads_disk}; store disk bytes "
              f"{before['disk_bytes']} -> {after['disk_bytes']}, attaches {before['attaches']} -> {after['attaches']}")
        assert list(final.token_ids) == tokens
        assert after["pid"] == before["pid"] == store.pid
        assert after["attaches"] > before["attaches"]
        assert final.usage.expert_reads_disk == 0 and final.usage.disk_bytes == 0
        assert final.usage.expert_reads_vram > 0          # VRAM slots refilled from host slots, not disk
        assert after["disk_bytes"] == before["disk_bytes"]
    finally:
        for w in workers:
            w.stop()
        store.stop()


@pytest.mark.slow
def test_store_kill_is_reported_and_recovered(wide, tmp_path):
    socks = StoreSockets(tmp_path)
    stores = [start_store(wide, socks, 2, 6)]
    port = free_port()
    worker = start_worker(wide, socks, port, 2, 6)
    try:
        tokens = list(generate(port, PROMPT, N_TOKENS).token_ids)
        assert stores[0].kill9() == -9
        with pytest.raises(grpc.RpcError) as err:
            generate(port, PROMPT, N_TOKENS, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (err.value.code(), err.value.details())
        assert "store" in err.value.details()
        wait_health(port, "NOT_SERVING", 10, proc=worker)
        with pytest.raises(grpc.RpcError) as err:           # refused while the store is away
            generate(port, PROMPT, N_TOKENS, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        stores.append(start_store(wide, socks, 2, 6))
        waited = wait_health(port, "SERVING", 30, proc=worker)
        final = generate(port, PROMPT, N_TOKENS)
        print(f"\n[recovery] store restarted (pid {stores[-1].pid}); worker SERVING again after {waited:.1f} s; "
              f"reads disk {final.usage.expert_reads_disk}")
        assert list(final.token_ids) == tokens
        assert store_status(socks.control)["pid"] == stores[-1].pid
        assert worker.alive() and health(port) == "SERVING"
    finally:
        assert worker.stop() == 0, worker.log()
        for s in stores:
            s.stop()
