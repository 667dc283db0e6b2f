"""The host slot arena: one memfd that the expert store and the GPU worker both map.

The store creates the memfd, pre-faults every page (so the whole arena is charged to the store's
cgroup at start-up, and an arena that does not fit fails there, not mid-run), and sends the fd to
the worker over a Unix socket (SCM_RIGHTS). Both sides `mmap(MAP_SHARED)` it; views are zero copy.
A memfd lives on the kernel-internal shmem mount, so a container's small /dev/shm does not bound
it, and it disappears with its last fd/mapping (nothing leaks on a crash). DESIGN.md §1.

torch is imported lazily: the store process never needs it, and the cgroup tests run children
under tight limits where importing torch alone would cost ~200 MiB.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
from typing import TYPE_CHECKING

import numpy as np

from betelgeuse.errors import StoreUnavailableError

if TYPE_CHECKING:  # pragma: no cover
    import torch

PAGE = 4096
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python 3.11 lacks the name
_PREFAULT_CHUNK = 1 << 30  # madvise in 1 GiB steps so a huge arena does not hold one syscall for seconds


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


class Arena:
    """A MAP_SHARED mapping of one memfd. `fd` and `nbytes` are what the peer needs to attach."""

    __slots__ = ("fd", "nbytes", "_mm", "_addr", "owner", "readonly")

    def __init__(self, fd: int, nbytes: int, owner: bool, readonly: bool = False):
        assert nbytes > 0 and nbytes % PAGE == 0, nbytes
        assert not (owner and readonly), "the store writes its arena"
        self.fd = fd
        self.nbytes = nbytes
        self.owner = owner  # True in the creating process (the store)
        self.readonly = readonly  # the worker's view: it only reads host slots and the directory
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        self._mm: mmap.mmap | None = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
        # the buffer export lasts only for this expression (numpy works on read-only mappings, ctypes does not)
        self._addr = int(np.frombuffer(self._mm, dtype=np.uint8, count=1).ctypes.data)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, nbytes: int, name: str = "betelgeuse-arena", prefault: bool = True) -> "Arena":
        """Create, size and map a new memfd arena (rounded up to 4 KiB). Check the budget first
        (cgroup.plan_memory): pre-faulting an arena that does not fit gets the process OOM-killed."""
        assert nbytes > 0, nbytes
        nbytes = round_up(nbytes)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            arena = cls(fd, nbytes, owner=True)
        except BaseException:
            os.close(fd)
            raise
        if prefault:
            arena.prefault()
        return arena

    @classmethod
    def attach(cls, fd: int, nbytes: int, readonly: bool = True) -> "Arena":
        """The worker side: map a received arena fd, read-only by default (the store hands out an O_RDONLY
        descriptor, so a writable mapping is refused by the kernel anyway). Takes ownership of `fd`."""
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise StoreUnavailableError(f"arena fd holds {size} bytes, expected {nbytes}")
        return cls(fd, nbytes, owner=False, readonly=readonly)

    def readonly_fd(self) -> int:
        """A new O_RDONLY descriptor of this memfd (a fresh open file description through /proc, not a dup),
        for handing to a worker: whoever holds it can map the arena for reading only. The caller closes it."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def prefault(self) -> None:
        """Allocate every page now, so the memcg charge lands here and now (shmem is charged to the
        cgroup that first faults a page in). Writes no data on the MADV_POPULATE_WRITE path."""
        mm = self._require()
        try:
            for off in range(0, self.nbytes, _PREFAULT_CHUNK):
                mm.madvise(MADV_POPULATE_WRITE, off, min(_PREFAULT_CHUNK, self.nbytes - off))
        except OSError:  # kernel < 5.14 (EINVAL): write one byte per page instead
            pages = np.frombuffer(mm, dtype=np.uint8)[::PAGE]
            pages[:] = pages.copy()  # a write fault per page, keeping any content (numpy skips a[:] = a)
            del pages

    # -- zero-copy views ---------------------------------------------------------------------
    def _require(self) -> mmap.mmap:
        assert self._mm is not None, "arena is closed"
        return self._mm

    def _check(self, offset: int, nbytes: int) -> None:
        assert 0 <= offset and 0 <= nbytes and offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)

    def view(self, offset: int, nbytes: int) -> memoryview:
        self._check(offset, nbytes)
        return memoryview(self._require())[offset : offset + nbytes]

    def numpy(self, offset: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
        """A 1-D array over [offset, offset+nbytes); nbytes must be a multiple of the item size."""
        self._check(offset, nbytes)
        dtype = np.dtype(dtype)
        assert nbytes % dtype.itemsize == 0, (nbytes, dtype)
        return np.frombuffer(self._require(), dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)

    def torch(self, offset: int, nbytes: int) -> "torch.Tensor":
        """A uint8 CPU tensor over [offset, offset+nbytes) (pinned once register_pinned ran). On a read-only
        arena the tensor must only be read: a write faults (SIGSEGV), which is the point."""
        import warnings

        import torch

        self._check(offset, nbytes)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(self._require(), dtype=torch.uint8, count=nbytes, offset=offset)

    def address(self) -> int:
        """Base virtual address of this process's mapping (page aligned)."""
        self._require()
        return self._addr

    def close(self) -> None:
        """Close the fd and unmap. If views are still alive the mapping stays valid until the last
        one is collected (mmap refuses to unmap exported buffers), so a stale view never faults."""
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass  # unmapped when the last view drops its reference
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- passing the fd ------------------------------------------------------------------------------
# Wire format on a SOCK_STREAM Unix socket: a 4-byte little-endian length, then that many bytes of
# UTF-8 JSON; the fds (the arena's, then the prefix host tier's if any) ride as SCM_RIGHTS ancillary data on the
# same sendmsg (so on the first byte).
_LEN = struct.Struct("<I")
MAX_FDS = 2


def send_fds(sock: socket.socket, fds: list[int], header: dict) -> None:
    assert 1 <= len(fds) <= MAX_FDS, fds
    body = json.dumps(header).encode()
    msg = _LEN.pack(len(body)) + body
    sent = socket.send_fds(sock, [msg], fds)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise StoreUnavailableError("store socket closed in the middle of the arena message")
        buf += chunk
    return bytes(buf)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (SO_PEERCRED, set by the
    kernel at connect time: it cannot be forged). pid is 0 when the peer is in another PID namespace."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def recv_fds(sock: socket.socket) -> tuple[list[int], dict]:
    """Receive the (fds, header) sent by send_fds. The caller owns the returned fds."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        raise StoreUnavailableError("store socket closed before the arena fd arrived")
    if not fds:
        raise StoreUnavailableError("arena message arrived without a file descriptor")
    try:
        data += _recv_exact(sock, _LEN.size - len(data)) if len(data) < _LEN.size else b""
        (n,) = _LEN.unpack(data)
        header = json.loads(_recv_exact(sock, n))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, header


# -- CUDA pinning ---------------------------------------------------------------------------------
def _cudart():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()


def register_pinned(arena: Arena) -> bool:
    """cudaHostRegister this process's mapping of the arena, so host->device copies from it run at
    pinned speed (registration is per process: the worker must do it itself). Returns False, doing
    nothing, where there is no CUDA. Flags 1 = cudaHostRegisterPortable, as torch's own
    torch.cuda._pin_memory_utils does; with UVA it is equivalent to 0 (feasibility.md §1b).
    One registration for the whole arena: a copy that spans two registrations is not pinned.
    Drivers R580+ refuse a single registration >= 512 GiB; we assert below that."""
    cudart = _cudart()
    if cudart is None:
        return False
    assert arena.nbytes < 512 << 30, "arenas >= 512 GiB must be registered in chunks"
    # 2 = cudaHostRegisterMapped: the device may read it in place (decode's at-hand experts: worker/at_hand.py;
    # implied under UVA, asked for anyway); 8 = cudaHostRegisterReadOnly: the worker's mapping is PROT_READ (the
    # device only reads it)
    flags = 1 | 2 | (8 if arena.readonly else 0)
    err = int(cudart.cudaHostRegister(arena.address(), arena.nbytes, flags))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of the {arena.nbytes}-byte arena failed with cudaError {err}")
    return True


def unregister_pinned(arena: Arena) -> bool:
    cudart = _cudart()
    if cudart is None:
        return False
    err = int(cudart.cudaHostUnregister(arena.address()))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister of the arena failed with cudaError {err}")
    return True


def device_address(arena: Arena) -> int | None:
    """The device address of this process's registered (register_pinned) mapping of the arena: kernels read it in
    place over PCIe. None where there is no CUDA or the driver gives no device mapping (the caller then copies
    through the ring as before)."""
    return host_device_address(arena.address())


def host_device_address(ptr: int) -> int | None:
    """The device address of page-locked host memory at `ptr` (registered mapped, or torch's pinned memory):
    cuMemHostGetDevicePointer through the driver library torch loaded; None without CUDA or a mapping."""
    if _cudart() is None:
        return None
    import ctypes
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    import torch
    torch.cuda.synchronize()            # a runtime call: the primary context current on this thread for the driver's
    out = ctypes.c_uint64(0)
    err = cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(ptr), ctypes.c_uint(0))
    return int(out.value) if err == 0 and out.value else None
