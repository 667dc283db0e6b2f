"""Memory budgets from the real cgroup (invariant 3): v2 (`memory.max`) or v1 (`memory.limit_in_bytes`).

Hybrid hosts mount both: a process sits in the v2 tree ("0::/...") even when the memory controller
is bound to v1, so we use v2 only where its mount enables the memory controller, else the v1
memory hierarchy. Mount points come from /proc/self/mountinfo (containers mount a sub-tree).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from betelgeuse.errors import BudgetError

V1_UNLIMITED = 1 << 62  # v1 reports "unlimited" as PAGE_COUNTER_MAX * page size (~9.2e18)
GiB = 1 << 30


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (FileNotFoundError, PermissionError):
        return None


def _write(path: str, value: str | int) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fstype, super options) of each cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            lf, rf = left.split(), right.split()
            if rf[0] in ("cgroup", "cgroup2"):
                out.append((lf[3], lf[4].replace("\\040", " "), rf[0], rf[2] if len(rf) > 2 else ""))
    return out


def _join(mount_root: str, mount_point: str, cg_path: str) -> str | None:
    """The directory of cgroup `cg_path` under a mount of the sub-tree `mount_root`."""
    if mount_root != "/" and not (cg_path == mount_root or cg_path.startswith(mount_root + "/")):
        return None
    rel = cg_path[len(mount_root):] if mount_root != "/" else cg_path
    return os.path.join(mount_point, rel.lstrip("/")).rstrip("/") or "/"


@dataclass(slots=True)
class CgroupMemory:
    version: int  # 1 or 2
    path: str  # the cgroup's directory, e.g. /sys/fs/cgroup/memory/process_api/<id>
    mount: str  # the hierarchy's mount point: ancestors are walked up to here
    created: bool = False  # made by make_cgroup: only these may be removed

    @classmethod
    def of_process(cls, pid: int | str = "self") -> "CgroupMemory | None":
        """The memory cgroup of a process, or None where there is no memory controller."""
        lines = _read(f"/proc/{pid}/cgroup")
        if lines is None:
            return None
        v1_path = v2_path = None
        for line in lines.splitlines():
            hid, ctrls, path = line.split(":", 2)
            if hid == "0" and ctrls == "":
                v2_path = path
            elif "memory" in ctrls.split(","):
                v1_path = path
        mounts = _mounts()
        if v2_path is not None:
            for root, mnt, fstype, _opts in mounts:
                if fstype == "cgroup2" and "memory" in (_read(os.path.join(mnt, "cgroup.controllers")) or "").split():
                    d = _join(root, mnt, v2_path)
                    if d and os.path.isdir(d):
                        return cls(2, d, mnt)
        if v1_path is not None:
            for root, mnt, fstype, opts in mounts:
                if fstype == "cgroup" and "memory" in opts.split(","):
                    d = _join(root, mnt, v1_path)
                    if d and os.path.isdir(d):
                        return cls(1, d, mnt)
        return None

    def _f(self, name: str) -> str | None:
        return _read(os.path.join(self.path, name))

    def _limit_at(self, d: str) -> int | None:
        raw = _read(os.path.join(d, "memory.max" if self.version == 2 else "memory.limit_in_bytes"))
        if raw is None or raw == "max":
            return None
        v = int(raw)
        return None if v >= V1_UNLIMITED else v

    def _ancestors(self):
        d = self.path
        while True:
            yield d
            if os.path.normpath(d) == os.path.normpath(self.mount):
                return
            d = os.path.dirname(d)

    def limit(self) -> int | None:
        """Effective limit in bytes: the minimum over this cgroup and its ancestors; None = unlimited."""
        lims = [v for v in (self._limit_at(d) for d in self._ancestors()) if v is not None]
        return min(lims) if lims else None

    def current(self) -> int:
        return int(self._f("memory.current" if self.version == 2 else "memory.usage_in_bytes") or 0)

    def stat(self) -> dict[str, int]:
        """memory.stat as {key: value}."""
        out = {}
        for line in (self._f("memory.stat") or "").splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out

    def reclaimable(self) -> int:
        """Page cache the kernel can drop under pressure: file pages that are not shared memory (the arena
        is shmem, and with no swap it is not reclaimable). v2: file - shmem; v1: cache - shmem."""
        st = self.stat()
        file = st.get("file", st.get("cache", 0))
        return max(0, file - st.get("shmem", 0))

    def in_use(self) -> int:
        """memory.current less reclaimable page cache: what a new allocation must fit beside."""
        return max(0, self.current() - self.reclaimable())

    def peak(self) -> int | None:
        raw = self._f("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return None if raw is None else int(raw)

    def oom_kills(self) -> int:
        raw = self._f("memory.events" if self.version == 2 else "memory.oom_control") or ""
        for line in raw.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def swap_limit(self) -> int | None:
        """Swap this cgroup may use, in bytes; None = unlimited or not accounted (v1 without memsw)."""
        if self.version == 2:
            raw = self._f("memory.swap.max")
            return None if raw in (None, "max") else int(raw)
        memsw, mem = self._f("memory.memsw.limit_in_bytes"), self._limit_at(self.path)
        if memsw is None or int(memsw) >= V1_UNLIMITED or mem is None:
            return None
        return int(memsw) - mem  # v1 memsw limits memory + swap together

    def pids(self) -> list[int]:
        return [int(x) for x in (self._f("cgroup.procs") or "").split()]


def _parent_for_new() -> CgroupMemory:
    own = CgroupMemory.of_process()
    if own is None:
        raise BudgetError("no memory cgroup controller on this machine: cannot create a memory cgroup")
    if own.version == 1:
        return own  # v1 has no "no internal processes" rule: nest under our own cgroup
    # v2: a child gets the memory controller only if its parent enables it in subtree_control,
    # which a cgroup with processes in it cannot (except the root); fall back to the root.
    if "memory" in (_read(os.path.join(own.path, "cgroup.subtree_control")) or "").split():
        return own
    return CgroupMemory(2, own.mount, own.mount)


def make_cgroup(name: str, memory_max: int, swap_max: int = 0, parent: CgroupMemory | None = None) -> CgroupMemory:
    """Create a child memory cgroup `name` with the given limits (bytes). v1: under this process's
    own memory cgroup; v2: under it if it delegates memory, else under the hierarchy root.
    Raises FileExistsError if `name` exists (it is not ours), PermissionError when not allowed."""
    assert name and "/" not in name and memory_max > 0 and swap_max >= 0, (name, memory_max, swap_max)
    parent = parent or _parent_for_new()
    d = os.path.join(parent.path, name)
    os.mkdir(d)
    cg = CgroupMemory(parent.version, d, parent.mount, created=True)
    try:
        if cg.version == 2:
            _write(os.path.join(d, "memory.max"), memory_max)
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), swap_max)
        else:
            _write(os.path.join(d, "memory.limit_in_bytes"), memory_max)
            if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):  # must stay >= the limit
                _write(os.path.join(d, "memory.memsw.limit_in_bytes"), memory_max + swap_max)
            if swap_max == 0:
                _write(os.path.join(d, "memory.swappiness"), 0)
    except BaseException:
        os.rmdir(d)
        raise
    return cg


def move_pid(cg: CgroupMemory, pid: int) -> None:
    """Move a process (all its threads) into `cg`."""
    _write(os.path.join(cg.path, "cgroup.procs"), int(pid))


def remove_cgroup(cg: CgroupMemory, timeout: float = 5.0) -> None:
    """Remove a cgroup made by make_cgroup. Processes still in it (the caller's own children) are
    moved to the parent first; no process is signalled."""
    assert cg.created, f"refusing to remove a cgroup we did not create: {cg.path}"
    parent = CgroupMemory(cg.version, os.path.dirname(cg.path), cg.mount)
    deadline = time.monotonic() + timeout
    while True:
        for pid in cg.pids():
            try:
                move_pid(parent, pid)
            except (ProcessLookupError, OSError):
                pass  # exited meanwhile
        try:
            os.rmdir(cg.path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a process was still leaving
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB ({n} bytes)"


def plan_memory(limit: int | None, current: int, arena_bytes: int, worker_reserve: int, headroom: int) -> None:
    """Refuse a configuration that cannot fit, before anything is allocated (invariant 3).
    All values in bytes; limit None = unlimited."""
    assert min(current, arena_bytes, worker_reserve, headroom) >= 0
    if limit is None:
        return
    need = arena_bytes + worker_reserve + current + headroom
    if need > limit:
        raise BudgetError(
            f"memory budget exceeded: arena {_fmt(arena_bytes)} + worker reserve {_fmt(worker_reserve)}"
            f" + in use {_fmt(current)} + headroom {_fmt(headroom)} = {_fmt(need)}"
            f" > cgroup limit {_fmt(limit)}; shrink the arena by at least {_fmt(need - limit)}"
        )
