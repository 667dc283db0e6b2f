"""Page-cache measurement for tests: which pages of a file are resident (mincore, like fincore)."""

import ctypes
import mmap
import os

import numpy as np

from betelgeuse.store.reader import drop_page_cache as drop_cache  # noqa: F401  (re-exported for the tests)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_map(path: str) -> np.ndarray:
    """bool [n_pages]: which 4 KiB pages of `path` are in the page cache (mincore on a private mapping)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable buffer for from_buffer
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        n = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * n)()
        rc = _libc.mincore(ctypes.addressof(anchor), size, vec)
        assert rc == 0, os.strerror(ctypes.get_errno())
        del anchor
        return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)
    finally:
        mm.close()


def resident_pages(path: str) -> int:
    return int(resident_map(path).sum())
