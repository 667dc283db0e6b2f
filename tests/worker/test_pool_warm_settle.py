"""A warm repeated prompt in `pool` routing reads nothing from disk (the reference report's row 4b), through a real
store process whose disk reads are slowed (BETELGEUSE_TEST_READ_JITTER): the cold pass's consolidation (the store's
host fills, the worker's VRAM fills, read-ahead still landing) must be over before the warm pass takes its resident
set. ModelRunner.settle waits for that (StoreSession.settle: the consolidation applied, the new VRAM tier filled, no
store read in flight) and says how long it waited; the warm pass then reads 0 bytes, and its routing (resident =
VRAM or host tier) and its accounting (reads by tier) agree. Without the settle the same warm pass reads the disk:
the check can fail."""

from __future__ import annotations

from dataclasses import replace

import pytest

from betelgeuse.config import EngineConfig
from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.store.reader import JITTER_ENV
from services.assembly import open_runner, open_store


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm_settle") / "ds4-16.gguf"
    write_model(path, replace(spec_from_preset("ds4-tiny"), n_expert=16, n_expert_used=4, seed=2), progress=False)
    return path


def _cold_then_warm(path, settle: bool) -> tuple:
    """A cold pool pass of a 64-token prompt (consolidating), settle or not, the same prompt warm -> (the warm pass's
    stats, store disk bytes during it, seconds settled or None)."""
    cfg = EngineConfig(model_path=str(path), vram_slots=3, host_slots=5, routing="pool", read_threads=2,
                       vram_backing=False)
    store = open_store(cfg, "process")
    rn = open_runner(cfg, store)
    try:
        ids = [(7 * i + 3) % 500 for i in range(64)]
        rn.forward(ids, rn.new_cache(72), consolidate=True)
        waited = rn.settle(timeout=60.0) if settle else None
        d0 = rn.store.status()["disk_bytes"]
        _, st = rn.forward(ids, rn.new_cache(72), consolidate=False)
        return st, rn.store.status()["disk_bytes"] - d0, waited
    finally:
        rn.close()
        store.close()


def test_warm_pool_pass_reads_nothing_after_settle(ds4, monkeypatch):
    monkeypatch.setenv(JITTER_ENV, "21:20")        # every disk read held back up to 20 ms: the fills land late
    st, disk, waited = _cold_then_warm(ds4, settle=True)
    assert waited is not None and waited >= 0.0
    assert st.reads["disk"] == 0 and st.disk_bytes == 0 and disk == 0, (st.reads, st.disk_bytes, disk)
    assert st.reads["vram"] + st.reads["host"] > 0
    # without the settle, the same warm pass takes a resident set whose bytes are still landing: it reads the disk
    st, disk, _ = _cold_then_warm(ds4, settle=False)
    assert disk > 0 and st.fill_disk > 0, (disk, st.fill_disk)
    # ... for the VRAM fills the pass waited for at its start (no host backing copy): its route counted those experts
    # as VRAM, and so does its accounting (fills are not uses): no use read the disk
    assert st.reads["disk"] == 0, st.reads
