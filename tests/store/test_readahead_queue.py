"""Reads ahead spend the disk on bytes that get used and never delay a demand read (store/store.py, store/reader.py),
through a real store process (`services.store_main`, gRPC on a Unix socket) on one slowed reader thread (the
test-only jitter holds each piece up to JITTER ms inside the thread, so reads queue as on a busy disk):

  drop     reads ahead a message drops (a scored layer's unused guesses, worker/guess.py) that have not started are
           never read: the pass's disk bytes, counted by the store's reader, fall to the few already started
  first    a demand load sent after a queue of reads ahead is read before them: one of the queued guesses itself
           (promoted to demand priority) and an expert nobody guessed, both landed while most guesses still wait
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_helpers import ENGINE_SPEC, write_synth

JITTER = "3:40"       # seed 3, each piece held up to 40 ms in its reader thread (a read itself takes ~0.1 ms here)
N_GUESS = 12


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from betelgeuse.config import EngineConfig
    from betelgeuse.store.directory import TIER_DISK, SlotDirectory
    from betelgeuse.store.reader import JITTER_ENV
    from services.assembly import open_store
    d = tmp_path_factory.mktemp("readahead-queue")
    cfg = EngineConfig(model_path=str(write_synth(d / "engine.gguf", **ENGINE_SPEC)), vram_slots=1, host_slots=2,
                       read_threads=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(JITTER_ENV, JITTER)                 # the store child inherits it
        child = open_store(cfg, "process", str(d / "store"), timeout=120.0)
    try:
        client = child.client
        arena, plan = client.attach()
        assert plan.n_staging // 2 >= N_GUESS + 2, plan.n_staging     # every guess gets a read-ahead slot
        tiers = SlotDirectory(arena, plan.layout, create=False).snapshot()["tier"]
        disk = {l: [int(e) for e in np.nonzero(tiers[l] == TIER_DISK)[0]] for l in range(plan.n_layer)}
        assert all(len(v) > N_GUESS for v in disk.values()), disk
        yield client, disk
    finally:
        child.close()


def _quiet(client) -> dict:
    """The store's status once no read is in flight."""
    t = time.monotonic()
    while (st := client.status())["reads_in_flight"]:
        assert time.monotonic() - t < 60, st
        time.sleep(0.01)
    return st


def _round(client, layer: int, guesses, demand, drop) -> dict:
    """One layer: its guesses read ahead (the answer waited for: they are queued before the load), then a load of
    `demand` dropping `drop` -> the status deltas once every read is done, and reads still in flight when the last
    demanded expert landed."""
    s0 = _quiet(client)
    client.begin_pass(True)
    assert client.prefetch(guesses) == len(guesses)
    slots = []
    for got in client.load(demand, drop=drop):
        slots.append(got.staging_slot)
    in_flight = client.status()["reads_in_flight"]
    client.release(slots)
    s1 = _quiet(client)
    # the guesses taken and handed back: no read-ahead copy left holding the read-ahead share of the staging slots
    client.release([got.staging_slot for got in client.load([k for k in guesses if k not in demand])])
    client.end_pass(np.zeros((ENGINE_SPEC["n_layer"], ENGINE_SPEC["n_expert"]), dtype=np.int64), False)
    keys = ("disk_bytes", "readahead_dropped", "readahead_promoted", "demand_started")
    return {"in_flight": in_flight, **{k: s1[k] - s0[k] for k in keys}}


def test_dropped_guesses_not_started_are_not_read(store):
    client, disk = store
    g1, g2 = ([(l, e) for e in disk[l][:N_GUESS]] for l in (1, 2))
    kept = _round(client, 1, g1, [(1, disk[1][N_GUESS])], drop=[])
    dropped = _round(client, 2, g2, [(2, disk[2][N_GUESS])], drop=g2)
    assert kept["readahead_dropped"] == 0 and dropped["readahead_dropped"] >= N_GUESS // 2, (kept, dropped)
    # the same geometry in both layers: N_GUESS + 1 reads against the demand read and the few guesses started
    assert dropped["disk_bytes"] <= kept["disk_bytes"] / 2, (kept, dropped)


def test_demand_load_is_read_before_queued_guesses(store):
    client, disk = store
    guesses = [(0, e) for e in disk[0][:N_GUESS]]
    r = _round(client, 0, guesses, [guesses[-1], (0, disk[0][N_GUESS])], drop=[])
    assert r["readahead_promoted"] == 1, r            # the last guess queued, now demanded
    # both demanded experts landed while most of the guesses queued before them had not
    assert r["in_flight"] >= N_GUESS // 2, r
