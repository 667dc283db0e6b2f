"""The store's Engram tier (store/engram.py) on a real file and a real memfd arena: rows land byte-exact and compact in
request order, pages are read once and coalesced, straddling rows read both pages, the row cache answers repeats,
and misuse is refused with a message."""

from __future__ import annotations

import numpy as np
import pytest

from betelgeuse.errors import BetelgeuseError
from betelgeuse.store.arena import Arena
from betelgeuse.store.engram import EngramLayout, EngramRows, EngramTable

ROW = 272                     # a Q8_0 row of 256 values
OFFSET = 1000                 # not page aligned, as a GGUF tensor (32-byte alignment only)


@pytest.fixture
def table(tmp_path):
    """A file whose row r of two tables holds bytes (r * 7 + i + table) % 251."""
    n = 2000
    data = np.zeros(OFFSET + 2 * n * ROW, dtype=np.uint8)
    for t in range(2):
        rows = (np.arange(n)[:, None] * 7 + np.arange(ROW)[None, :] + t) % 251
        data[OFFSET + t * n * ROW: OFFSET + (t + 1) * n * ROW] = rows.reshape(-1)
    path = tmp_path / "table.bin"
    data.tofile(path)
    tables = [EngramTable(1, OFFSET, ROW, n, 8), EngramTable(14, OFFSET + n * ROW, ROW, n, 8)]
    return path, tables


def _rows(path, tables, cache_bytes=64 * ROW):
    lay = EngramLayout.for_tables(tables, 0, 48, cache_bytes, n_banks=2)
    arena = Arena.create(lay.nbytes)
    return EngramRows(str(path), arena, lay, read_depth=4), arena, lay


def _want(t, r):
    return (r * 7 + np.arange(ROW) + t) % 251


def test_rows_land_exact_coalesced_and_cached(table):
    path, tables = table
    er, arena, lay = _rows(path, tables)
    try:
        # rows 0 and 1 share page 0; row 11 crosses the page boundary (bytes 3992..4264: pages 0 and 1); table 1's
        # row 3 (page 133) and table 0's row 1500 (page 99) are far away
        tables_ix = np.array([0, 0, 0, 1, 0])
        rows = np.array([0, 1, 11, 3, 1500])
        bank = er.read(tables_ix, rows)
        got = er.wait(bank, timeout=10)
        compact = arena.numpy(lay.bank_rows_offset(bank), 5 * lay.stride).reshape(5, lay.stride)
        for k, (t, r) in enumerate(zip(tables_ix, rows)):
            assert np.array_equal(compact[k, :ROW], _want(t, r)), (t, r)
        # pages: 0 (rows 0, 1, 11), 1 (row 11's tail), table 1's row 3 and row 1500: 4 pages, runs 0-1 coalesced
        assert (got.rows, got.disk_rows, got.cache_rows) == (5, 5, 0)
        assert got.disk_bytes == 4 * 4096
        er.release([bank])
        bank = er.read(np.array([0, 0]), np.array([11, 12]))              # 11 from the cache, 12 from disk
        got = er.wait(bank, timeout=10)
        assert (got.disk_rows, got.cache_rows) == (1, 1)
        compact = arena.numpy(lay.bank_rows_offset(bank), 2 * lay.stride).reshape(2, lay.stride)
        assert np.array_equal(compact[0, :ROW], _want(0, 11)) and np.array_equal(compact[1, :ROW], _want(0, 12))
        st = er.status()
        assert st["engram_disk_rows"] == 6 and st["engram_cache_rows"] == 1 and st["engram_read_mode"] in (
            "direct", "buffered")
    finally:
        er.close()
        arena.close()


def test_banks_are_bounded_and_misuse_is_refused(table):
    path, tables = table
    er, arena, lay = _rows(path, tables, cache_bytes=0)
    try:
        a = er.read(np.array([0]), np.array([7]))
        b = er.read(np.array([1]), np.array([8]))
        with pytest.raises(BetelgeuseError, match="no free Engram bank"):
            er.read(np.array([0]), np.array([9]))
        er.release([a])                                  # freed once landed (now, or when its read lands)
        er.wait(b, timeout=10)
        c = er.read(np.array([0]), np.array([9]), release=[b])
        assert er.wait(c, timeout=10).disk_rows == 1     # no cache: read from disk
        er.release([c])
        with pytest.raises(BetelgeuseError, match="past the end of its table"):
            er.read(np.array([0]), np.array([2000]))
        with pytest.raises(BetelgeuseError, match="1..48 rows"):
            er.read(np.zeros(49, np.int64), np.arange(49))
        with pytest.raises(BetelgeuseError, match="holds no request"):
            er.wait(1, timeout=1)
    finally:
        er.close()
        arena.close()


def test_rows_of_a_file_changed_meanwhile_are_refused(table):
    """As expert loads (store/watch.py): a read that lands after the file was written to is an error, not rows."""
    from betelgeuse.store.watch import ModelWatch
    path, tables = table
    lay = EngramLayout.for_tables(tables, 0, 48, 0, n_banks=2)
    arena = Arena.create(lay.nbytes)
    watch = ModelWatch(str(path), OFFSET)
    er = EngramRows(str(path), arena, lay, read_depth=2, watch=watch)
    try:
        er.wait(er.read(np.array([0]), np.array([3])), timeout=10)       # unchanged: fine
        with open(path, "r+b") as f:                                    # overwritten in place
            f.seek(OFFSET + 5 * ROW)
            f.write(b"\xff" * ROW)
        watch.check()
        with pytest.raises(BetelgeuseError, match="model file changed"):
            er.wait(er.read(np.array([0]), np.array([5])), timeout=10)
    finally:
        er.close()
        arena.close()
        watch.close()
