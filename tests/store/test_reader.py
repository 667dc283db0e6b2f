"""ExpertReader against a real file on a real disk: bytes, page cache (mincore), priorities, fallback."""

import os
import random
import time

import numpy as np
import pytest

from betelgeuse.errors import ModelFormatError
from betelgeuse.store.arena import Arena
from betelgeuse.store.reader import JITTER_ENV, PAGE, ExpertReader, Jitter, fs_type
from pagecache import drop_cache, resident_pages

DISK_DIR = "/var/tmp"
FILE_BYTES = (24 << 20) + 1000  # not a multiple of 4 KiB: the last rounded read runs past EOF

def _make_file(directory: str, nbytes: int, seed: int) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    path = os.path.join(directory, f"bg-reader-{os.getpid()}-{seed}.bin")
    with open(path, "wb") as f:
        f.write(data.tobytes())
    drop_cache(path)
    return path, data


@pytest.fixture(scope="module")
def disk_file():
    kind = fs_type(DISK_DIR)
    if kind in ("tmpfs", "ramfs", "overlay", ""):
        pytest.skip(f"{DISK_DIR} is {kind or 'unknown'}, not a block-device filesystem")
    path, data = _make_file(DISK_DIR, FILE_BYTES, seed=1)
    yield path, data
    os.unlink(path)


def _random_ranges(rng: random.Random, file_size: int, count: int, max_len: int):
    """(off, n, dest) with unaligned offsets, packed into consecutive 4 KiB-aligned destinations."""
    out, dest = [], 0
    for _ in range(count):
        n = rng.randint(1, max_len)
        off = rng.randrange(0, file_size - n + 1)
        out.append((off, n, dest))
        span = -(-(off + n) // PAGE) * PAGE - (off - off % PAGE)
        dest += span
    return out, dest


def _check(arena, data, ranges):
    for off, n, dest in ranges:
        got = arena.numpy(dest + off % PAGE, n)
        assert np.array_equal(got, data[off : off + n]), (off, n, dest)


def test_direct_random_ranges_match_file_and_bypass_page_cache(disk_file):
    path, data = disk_file
    rng = random.Random(7)
    ranges, need = _random_ranges(rng, FILE_BYTES, 60, 300_000)
    ranges.append((FILE_BYTES - 777, 777, need))  # the last bytes: rounded read runs past EOF
    need += PAGE
    drop_cache(path)
    before = resident_pages(path)
    with Arena.create(need) as arena:
        arena.numpy(0, need)[:] = 0xAB  # garbage that must be overwritten (incl. the zeroed EOF tail)
        with ExpertReader(path, arena, threads=4, request_bytes=64 << 10) as reader:
            assert reader.mode == "direct"
            reader.read(ranges[:30], priority=1).result(timeout=60)
            reader.read(ranges[30:], priority=0).result(timeout=60)
            st = reader.stats.copy()
        _check(arena, data, ranges)
        tail = arena.numpy(ranges[-1][2], PAGE)
        assert np.all(tail[(FILE_BYTES - 777) % PAGE + 777 :] == 0), "bytes past EOF must read as zero"
    after = resident_pages(path)
    assert before <= 2, f"cache drop did not work: {before} pages resident"
    assert after - before <= 2, f"O_DIRECT reads grew the page cache by {after - before} pages"
    spans = sum(-(-(o + n) // PAGE) * PAGE - (o - o % PAGE) for o, n, _ in ranges)
    assert st.payload_bytes == sum(n for _, n, _ in ranges)
    assert st.bytes_read == spans - (PAGE - (FILE_BYTES % PAGE))  # the device bytes stop at EOF
    assert st.requests == [1, 1] and st.reads >= len(ranges) and st.busy_seconds > 0


def test_active_seconds_count_the_disk_busy_not_the_threads_or_the_gaps(disk_file):
    """active_seconds: wall time with a read in flight. Overlapping pieces on 4 threads count once (<= the threads'
    summed busy seconds), and an idle gap between two reads not at all (the disk-busy fraction the bench prints)."""
    path, _ = disk_file
    ranges, need = _random_ranges(random.Random(3), FILE_BYTES, 24, 1 << 20)
    with Arena.create(need) as arena, ExpertReader(path, arena, threads=4, request_bytes=256 << 10) as reader:
        t = time.perf_counter()
        reader.read(ranges[:12], priority=0).result(timeout=60)
        time.sleep(0.3)                                     # the disk idles
        reader.read(ranges[12:], priority=1).result(timeout=60)
        wall = time.perf_counter() - t
        st = reader.stats.copy()
        active = reader.active_seconds()
    assert 0 < st.active_seconds == active <= st.busy_seconds + 1e-6, (active, st.busy_seconds)
    assert active < wall - 0.25, (active, wall)


def test_page_cache_measurement_can_fail(disk_file):
    """Positive control for resident_pages: a plain buffered read does fill the cache."""
    path, _ = disk_file
    drop_cache(path)
    with open(path, "rb") as f:
        f.read(1 << 20)
    assert resident_pages(path) >= 200
    drop_cache(path)
    assert resident_pages(path) <= 2


def test_forced_buffered_mode_reads_right_and_drops_its_pages(disk_file):
    path, data = disk_file
    ranges, need = _random_ranges(random.Random(3), FILE_BYTES, 20, 200_000)
    drop_cache(path)
    with Arena.create(need) as arena, ExpertReader(path, arena, threads=2, direct=False) as reader:
        assert reader.mode == "buffered"
        reader.read(ranges).result(timeout=60)
        _check(arena, data, ranges)
    assert resident_pages(path) <= 4, "buffered fallback must POSIX_FADV_DONTNEED what it read"


def test_jitter_lands_reads_late_and_out_of_order(disk_file, monkeypatch):
    """The test-only adversary (store/reader.py Jitter, tests/worker/test_adversarial_timing.py): each read's future resolves
    up to max_s late, in an order unrelated to the order asked, with the right bytes; the pieces of one read land late
    and out of order; off unless asked for."""
    path, data = disk_file
    monkeypatch.delenv(JITTER_ENV, raising=False)
    with Arena.create(PAGE) as arena, ExpertReader(path, arena, threads=1) as reader:
        assert reader.jitter is None
    ranges = [(i * 3 * PAGE + 5, 100, i * PAGE) for i in range(16)]
    with Arena.create(16 * PAGE) as arena, ExpertReader(path, arena, threads=2, jitter=Jitter(5, 0.03)) as reader:
        order = []
        futures = [reader.read([r]) for r in ranges]
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _, i=i: order.append(i))
        for f in futures:
            f.result(timeout=30)
        _check(arena, data, ranges)
    assert sorted(order) == list(range(16)) and order != list(range(16)), order
    # a slow disk: the pieces of ONE read (16 one-page preadv calls) land late and in any order, the bytes right
    with Arena.create(16 * PAGE) as arena, ExpertReader(path, arena, threads=2, request_bytes=PAGE,
                                                        jitter=Jitter(6, 0.01)) as reader:
        landed, read_piece = [], reader._read_piece
        reader._read_piece = lambda p: (read_piece(p), landed.append(p.offset // PAGE))
        one = [(PAGE + 7, 15 * PAGE, 0)]                   # 16 pages from file page 1
        reader.read(one).result(timeout=30)
        _check(arena, data, one)
    assert sorted(landed) == list(range(1, 17)) and landed != sorted(landed), landed


def test_demand_overtakes_read_ahead(disk_file):
    path, data = disk_file
    piece = 256 << 10
    ahead = [(i * piece, piece, i * piece) for i in range(FILE_BYTES // piece)]  # ~24 MiB, 96 pieces
    demand_dest = len(ahead) * piece
    drop_cache(path)
    with Arena.create(demand_dest + 2 * PAGE) as arena, ExpertReader(path, arena, threads=2, request_bytes=piece) as reader:
        order = []
        f_ahead = reader.read(ahead, priority=1)
        f_demand = reader.read([(12345, 4000, demand_dest)], priority=0)
        f_ahead.add_done_callback(lambda f: order.append("ahead"))
        f_demand.add_done_callback(lambda f: order.append("demand"))
        f_demand.result(timeout=60)
        demand_done_with_ahead_pending = not f_ahead.done()
        f_ahead.result(timeout=60)
        assert order == ["demand", "ahead"]
        assert demand_done_with_ahead_pending
        _check(arena, data, ahead + [(12345, 4000, demand_dest)])


def test_tmpfs_falls_back_to_buffered():
    if not os.path.isdir("/dev/shm") or fs_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    path, data = _make_file("/dev/shm", (1 << 20) + 5, seed=2)
    try:
        ranges, need = _random_ranges(random.Random(5), len(data), 25, 50_000)
        ranges.append((len(data) - 5, 5, need))
        with Arena.create(need + PAGE) as arena, ExpertReader(path, arena, threads=2) as reader:
            assert reader.mode == "buffered"
            reader.read(ranges).result(timeout=30)
            _check(arena, data, ranges)
    finally:
        os.unlink(path)


def test_user_errors_name_the_problem(disk_file, tmp_path):
    path, _ = disk_file
    with Arena.create(1 << 20) as arena:
        with pytest.raises(ModelFormatError, match="not found"):
            ExpertReader(str(tmp_path / "missing.gguf"), arena)
        with ExpertReader(path, arena, threads=1) as reader:
            with pytest.raises(ModelFormatError, match="past the end"):
                reader.read([(FILE_BYTES - 10, 20, 0)])
            assert not reader.read([(0, 10, 0)]).cancel(), "a running read cannot be cancelled"


def test_piece_queue_order_and_take_first():
    """The reader's queue (store61): entries come out smallest first, whenever put (as queue.PriorityQueue's did), and
    take_first takes the next entry with its wake-up token only where want() accepts it: each token left still finds
    an entry (a get never finds the heap empty), and none is left over."""
    import queue as queue_mod
    from betelgeuse.store.reader import _PieceQueue
    q = _PieceQueue()
    q.put_many([(1, 0, "ahead-a"), (0, 1, "demand-a")])
    q.put_many([(1, 2, "ahead-b"), (0, 3, "demand-b")])
    assert q.take_first(lambda e: e[0] == 1) is None and q.qsize() == 4      # the next is demand-a: not taken
    assert q.take_first(lambda e: e[2] == "demand-a") == (0, 1, "demand-a")
    assert [q.get()[2] for _ in range(3)] == ["demand-b", "ahead-a", "ahead-b"]
    assert q.qsize() == 0 and q.take_first(lambda e: True) is None
    with pytest.raises(queue_mod.Empty):
        q._tokens.get_nowait()                   # no token left over: a reader thread would wait, not pop nothing
