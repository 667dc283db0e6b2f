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


def test_two_staging_slots_deliver_every_expert_intact(tmp_path):
    path = write_synth(tmp_path / "m.gguf", **ENGINE_SPEC)
    f = GGUFModelFile.open(str(path))
    cfg = EngineConfig(model_path=str(path), vram_slots=0, host_slots=0, staging_slots=2)
    store = ExpertStore(f, plan_slots(f, cfg, None), read_threads=4)
    try:
        session, _ = store.attach(os.getpid())
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
                    assert _expert_bytes_ok(store, got.layer, got.expert, got.slot), (rounds, got)
                    store.release(session, [got.slot])  # the worker copied it
                assert len(seen) == E
            store.end_pass(session, np.zeros((ENGINE_SPEC["n_layer"], E), dtype=np.int64), False)
        st = store.status()
        assert st["demand_loads"] == 3 * ENGINE_SPEC["n_layer"] * E
        assert st["disk_reads"] > 0 and store.reader.mode in ("direct", "buffered")
    finally:
        store.close()
