"""The expert store's staging logic under pressure: few staging slots, demand loads interleaved with
read-ahead, every delivered slot holding exactly the expert's bytes from the file (checked with os.pread)."""

import os

import numpy as np

from betelgeuse.config import EngineConfig
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.plan import plan_slots
from betelgeuse.store.store import ExpertStore
from engine_helpers import ENGINE_SPEC, write_synth


def _expert_bytes_ok(store: ExpertStore, layer: int, expert: int, slot: int) -> bool:
    off = store.layout.staging_slot_offset(slot)
    fd = os.open(store.model.path, os.O_RDONLY)
    try:
        for k, part in enumerate(store.model.expert_parts(layer, expert)):
            start = off + store.layout.slot.part_place(k) + part.offset % 4096
            got = store.arena.numpy(start, part.nbytes)
            if not np.array_equal(got, np.frombuffer(os.pread(fd, part.nbytes, part.offset), dtype=np.uint8)):
                return False
    finally:
        os.close(fd)
    return True


def _store(tmp_path, staging_slots: int, read_threads: int) -> tuple[ExpertStore, str]:
    """A store over a tiny synth model with no VRAM or host slots (every expert through staging), attached."""
    path = write_synth(tmp_path / "m.gguf", **ENGINE_SPEC)
    f = GGUFModelFile.open(str(path))
    cfg = EngineConfig(model_path=str(path), vram_slots=0, host_slots=0, staging_slots=staging_slots)
    store = ExpertStore(f, plan_slots(f, cfg, None), read_threads=read_threads)
    session, _ = store.attach(os.getpid())
    return store, session


def test_two_staging_slots_deliver_every_expert_intact(tmp_path):
    store, session = _store(tmp_path, staging_slots=2, read_threads=4)
    try:
        E = ENGINE_SPEC["n_expert"]
        for rounds in range(3):                      # later rounds hit the staged copies (victim cache)
            store.begin_pass(session)
            for layer in range(ENGINE_SPEC["n_layer"]):
                if layer + 1 < ENGINE_SPEC["n_layer"]:
                    store.prefetch(session, [(layer + 1, e) for e in range(E)])
                seen = set()
                for got in store.load(session, [(layer, e) for e in range(E)]):
                    assert (got.layer, got.expert) not in seen
                    seen.add((got.layer, got.expert))
                    assert _expert_bytes_ok(store, got.layer, got.expert, got.staging_slot), (rounds, got)
                    store.release(session, [got.staging_slot])  # the worker copied it
                assert len(seen) == E
            store.end_pass(session, np.zeros((ENGINE_SPEC["n_layer"], E), dtype=np.int64), False)
        st = store.status()
        assert st["demand_loads"] == 3 * ENGINE_SPEC["n_layer"] * E
        assert st["disk_reads"] > 0 and store.reader.mode in ("direct", "buffered")
    finally:
        store.close()


def test_an_expert_read_again_while_held_loses_no_staging_slot(tmp_path):
    """The worker's Release and its next Load are separate gRPC calls and may arrive in either order: a Load can ask
    for an expert whose copy the worker still holds (its Release not arrived yet), so the store reads it into a
    second slot. Handing both back (in either order, and with the second still landing) must leave every staging
    slot free or staged: a slot in none is lost for good, and once all are, every load waits forever (a live
    `serve` failed requests with "expert store unavailable (DEADLINE_EXCEEDED)" after 14 s)."""
    store, session = _store(tmp_path, staging_slots=4, read_threads=2)
    try:
        key = (0, 3)
        for order in ("first", "second", "landing"):
            store.begin_pass(session)
            (a,) = list(store.load(session, [key]))
            if order == "landing":                      # a second copy read ahead, handed back while it lands
                assert store.prefetch(session, [key]) == 1
                store.release(session, [a.staging_slot])
                (b,) = list(store.load(session, [key]))
                store.release(session, [b.staging_slot])
            else:
                (b,) = list(store.load(session, [key]))     # read again while the worker holds the first copy
                assert b.staging_slot != a.staging_slot
                assert _expert_bytes_ok(store, *key, b.staging_slot)
                first, second = (a, b) if order == "first" else (b, a)
                store.release(session, [first.staging_slot])
                store.release(session, [second.staging_slot])
            store.end_pass(session, np.zeros((ENGINE_SPEC["n_layer"], ENGINE_SPEC["n_expert"]), dtype=np.int64),
                           False)
            assert store.unaccounted_slots() == [], order
            with store.cv:
                assert list(store._staged).count(key) == 1 and not store._handed, order
        # and all staging slots still serve a load of as many experts as there are slots
        store.begin_pass(session)
        got = list(store.load(session, [(1, e) for e in range(store.plan.n_staging)]))
        assert len(got) == store.plan.n_staging
    finally:
        store.close()


def test_a_cancelled_load_hands_nothing_more_and_a_failed_pass_loses_no_slot(tmp_path):
    """A pass that fails mid-layer leaves its load stream with experts still landing (its gRPC call cancelled:
    alive() false) and the slots it was handed unreleased. The cancelled load hands over nothing more (what lands
    stays staged, for the next load), and the slots still handed when the pass ends are taken back: after it, every
    staging slot serves a load again. Before: they stayed the worker's for good (loads then waited for slots)."""
    store, session = _store(tmp_path, staging_slots=6, read_threads=2)
    L, E = ENGINE_SPEC["n_layer"], ENGINE_SPEC["n_expert"]
    try:
        store.begin_pass(session)
        live = [True]
        it = store.load(session, [(0, e) for e in range(6)], alive=lambda: live[0])
        first = next(it)                            # the worker took one, then its pass failed
        live[0] = False
        assert list(it) == []                       # cancelled: nothing more is handed
        with store.cv:
            assert set(store._handed) == {first.staging_slot}
        store.end_pass(session, np.zeros((L, E), dtype=np.int64), False)   # the abandoned pass's end: no release
        assert store.status()["staging_handed"] == 0 and store.status()["staging_reclaimed"] == 1
        assert store.unaccounted_slots() == []
        store.begin_pass(session)
        got = list(store.load(session, [(1, e) for e in range(store.plan.n_staging)]))
        assert len(got) == store.plan.n_staging and all(_expert_bytes_ok(store, g.layer, g.expert, g.staging_slot)
                                                        for g in got)
        store.release(session, [g.staging_slot for g in got])
        store.end_pass(session, np.zeros((L, E), dtype=np.int64), False)
        assert store.status()["staging_reclaimed"] == 1               # a healthy pass hands every slot back itself
    finally:
        store.close()


def test_a_write_to_the_model_file_during_a_read_fails_the_read(tmp_path):
    """A read's bytes count only if the file was not written to from before the read to after it landed (store61: the
    read's stamp is the load's check's, no fstat of its own): the same bytes written back in place while the read is
    in flight (content unchanged, ctime moved) fail the load; a load after it reads and hands over as before."""
    import threading

    import pytest

    from betelgeuse.errors import BetelgeuseError
    store, session = _store(tmp_path, staging_slots=4, read_threads=2)
    hold = threading.Event()
    store.reader.on_read = lambda _s: hold.wait(5)        # each piece held after its preadv until the write is done
    try:
        store.begin_pass(session)
        it = store.load(session, [(0, 1)], started=True)
        next(it)                                          # the read started
        with open(store.model.path, "r+b") as f:          # the same bytes again: only the stamp moves
            head = f.read(4096)
            f.seek(0)
            f.write(head)
        hold.set()
        with pytest.raises(BetelgeuseError, match="changed during the read"):
            list(it)
        got = list(store.load(session, [(0, 1)]))
        assert len(got) == 1 and _expert_bytes_ok(store, 0, 1, got[0].staging_slot)
    finally:
        hold.set()
        store.close()
