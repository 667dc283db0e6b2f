"""The prefix host tier's save file (store/prefix_disk.py): the worker's own writer (worker/prefix_host.py) fills a
region, the store saves it and a new region (a restarted store's memfd) loads it back, bit for bit; only what changed
is written again; an entry the worker is writing is not saved; another model file, another geometry, a truncated or
corrupt file is ignored (the tier starts empty), never an error. The whole service restarted: tests/services/
test_prefix_restart.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from betelgeuse.gguf.synth import PRESETS, write_model
from betelgeuse.store.arena import Arena
from betelgeuse.store.prefix_disk import PrefixDisk
from betelgeuse.worker.prefix_host import HostTier

ROOT = b""                                          # the shared cache's chain root (worker/prefix_cache.py)
KEYS = [bytes([i + 1]) * 15 + b"\0" for i in range(6)]    # digests ending in a zero byte too (16 raw bytes)
REGION = 8 * 4096                                   # header, entry table, 6 slots of 4 KiB


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix-disk") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], progress=False)
    return str(path)


def _tier(arena: Arena, block=2, dtype=torch.float32) -> HostTier:
    return HostTier(arena, 2, 1, 4, block, dtype, 8)    # 4 KiB slots


def _block(seed: int) -> torch.Tensor:
    return torch.randn((2, 2, 1, 2, 4), generator=torch.Generator().manual_seed(seed))


def _fill(arena: Arena, n: int) -> HostTier:
    tier = _tier(arena)
    for i in range(n):
        tier.put(KEYS[i], ROOT if i == 0 else KEYS[i - 1], (i, i + 1), _block(i),
                 torch.arange(8.0) + i if i == n - 1 else None)
    return tier


def _saved(model, path, n=3) -> None:
    with Arena.create(REGION) as region:
        _fill(region, n)
        disk = PrefixDisk(str(path), region, model)
        assert disk.save() and disk.stats.file_entries == n
        disk.close()


def _loaded(model, path, nbytes=REGION, **kw) -> tuple[int, PrefixDisk, Arena]:
    region = Arena.create(nbytes)
    disk = PrefixDisk(str(path), region, model)
    return disk.load(), disk, region


def test_a_saved_tier_comes_back_bit_for_bit_and_only_changes_are_written(model, tmp_path):
    path = tmp_path / "prefix.bin"
    with Arena.create(REGION) as region:
        tier = _fill(region, 3)
        disk = PrefixDisk(str(path), region, model)
        assert disk.save() and disk.stats.saved_entries == 3 and disk.mode == "direct"
        wrote = disk.stats.saved_bytes
        assert disk.save() and disk.stats.saved_bytes == wrote           # nothing changed: nothing written
        tier.put(KEYS[3], KEYS[2], (3, 4), _block(3))
        assert disk.save() and disk.stats.saved_entries == 4              # only the new entry's slot
        assert disk.stats.saved_bytes - wrote < 2 * tier.slot_bytes + 4 * 4096
        tier.ent["seq"][tier.index[KEYS[1]]] |= 1                           # the worker rewrites entry 1 ...
        assert disk.save() and disk.stats.file_entries == 3                # ... the file forgets it
        tier.ent["seq"][tier.index[KEYS[1]]] += 1
        assert disk.save() and disk.stats.file_entries == 4
        del tier
        disk.close()
    n, disk, fresh = _loaded(model, path)
    assert n == 4 and disk.stats.loaded_entries == 4
    tier = _tier(fresh)                                                     # the worker attaches: adopts them all
    assert tier.adopted and set(tier.index) == set(KEYS[:4])
    kv, logits = torch.zeros(2, 2, 1, 2, 4), torch.zeros(8)
    for i in range(4):
        slot = tier.find(KEYS[i], (i, i + 1), ROOT if i == 0 else KEYS[i - 1])
        assert slot is not None, i
        tier.get(slot, kv, logits if tier.whole(slot) else None)
        assert torch.equal(kv, _block(i))
    assert torch.equal(logits, torch.arange(8.0) + 2)
    # the worker's clock goes on from the saved one: a new entry is the most recently used
    assert tier.put(KEYS[4], KEYS[3], (4, 5), _block(4)) and tier.ent["stamp"].max() == tier.ent["stamp"][
        tier.index[KEYS[4]]]
    del tier
    fresh.close()


def test_a_smaller_region_takes_the_most_recently_used_entries(model, tmp_path):
    path = tmp_path / "prefix.bin"
    _saved(model, path, n=5)
    n, disk, small = _loaded(model, path, nbytes=4 * 4096)                 # room for 2 slots
    tier = _tier(small)
    assert n == 2 and tier.adopted and set(tier.index) == {KEYS[3], KEYS[4]}
    kv = torch.zeros(2, 2, 1, 2, 4)
    tier.get(tier.find(KEYS[4], (4, 5), KEYS[3]), kv)
    assert torch.equal(kv, _block(4))
    # its next save writes the file anew for this region (the old layout's entries are gone)
    assert disk.save() and disk.stats.file_entries == 2
    disk.close()
    del tier
    small.close()
    n, disk, again = _loaded(model, path, nbytes=4 * 4096)
    assert n == 2
    disk.close()
    again.close()


def test_another_model_geometry_or_a_truncated_corrupt_file_is_ignored(model, tmp_path):
    path = tmp_path / "prefix.bin"
    _saved(model, path)
    other = str(tmp_path / "other.gguf")                                    # the same bytes at another path
    shutil.copy(model, other)
    n, disk, region = _loaded(other, path)
    assert n == 0 and "another model" in disk.stats.load_note and not _tier(region).adopted
    # another geometry (a worker started with another dtype): the worker formats the region anew
    n, disk, region = _loaded(model, path)
    assert n == 3
    tier = _tier(region, dtype=torch.bfloat16)
    assert not tier.adopted and tier.index == {}
    # a corrupt slot: that entry is dropped, the others load
    raw = bytearray(path.read_bytes())
    slots = len(raw) - 6 * 4096                                             # slot 0 starts 6 slots before the end
    raw[slots + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    n, disk, region = _loaded(model, path)
    assert n == 2 and set(_tier(region).index) == set(KEYS[1:3])
    # truncated, or not a prefix cache file at all: ignored, the region stays empty
    path.write_bytes(bytes(raw[:len(raw) // 2]))
    n, disk, region = _loaded(model, path)
    assert n == 0 and "truncated" in disk.stats.load_note and not _tier(region).adopted
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 3 * 4096, dtype=np.uint8).tobytes())
    n, disk, region = _loaded(model, path)
    assert n == 0 and "not a prefix cache file" in disk.stats.load_note and not _tier(region).adopted
    path.unlink()
    n, disk, region = _loaded(model, path)
    assert n == 0 and disk.stats.load_note == ""


def test_a_save_stops_when_a_pass_begins_and_goes_on_later(model, tmp_path):
    path = tmp_path / "prefix.bin"
    with Arena.create(REGION) as region:
        tier = _fill(region, 4)
        disk = PrefixDisk(str(path), region, model)
        calls = []
        assert not disk.save(abort=lambda: calls.append(1) or len(calls) > 2)   # two slots, then a pass
        assert disk.stats.file_entries == 2 and disk.stats.aborted == 1
        assert disk.save() and disk.stats.file_entries == 4 and disk.stats.saved_entries == 4
        del tier
        disk.close()
    n, disk, region = _loaded(model, path)
    assert n == 4
