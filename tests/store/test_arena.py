"""The memfd arena and the slot directory across real processes, sockets and cgroups."""

import os
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from betelgeuse.errors import StoreUnavailableError
from betelgeuse.store.arena import Arena, recv_fds, register_pinned, send_fds
from betelgeuse.store.cgroup import CgroupMemory, make_cgroup, remove_cgroup
from betelgeuse.store.directory import TIER_DISK, TIER_HOST, TIER_VRAM, SlotDirectory
from betelgeuse.store.layout import ArenaLayout, SlotLayout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20

# The worker side, as a separate interpreter: receive the fd, attach, check and write patterns,
# read the directory the store wrote.
WORKER = textwrap.dedent(
    """
    import socket, sys
    import numpy as np
    from betelgeuse.store.arena import Arena, recv_fds
    from betelgeuse.store.directory import SlotDirectory
    from betelgeuse.store.layout import ArenaLayout
    sock = socket.socket(fileno=int(sys.argv[1]))
    (fd,), hdr = recv_fds(sock)
    arena = Arena.attach(fd, hdr["nbytes"], readonly=False)   # the store's own O_RDWR fd: this test writes back
    lay = ArenaLayout.from_dict(hdr["layout"])
    d = SlotDirectory(arena, lay, create=False)
    off = lay.host_slot_offset(1, 2)
    seen = arena.numpy(off, 4096)
    ok = bool(np.array_equal(seen, np.arange(4096) % 251))
    arena.torch(off + 4096, 4096)[:] = 7                       # the worker writes, the store sees
    snap = d.snapshot()
    sock.sendall(repr((ok, d.lookup(1, 3), int(snap["tier"].sum()), d.epoch, d.store_pid, d.pass_active)).encode())
    sock.recv(1)                                               # wait until the parent has looked
    """
)


def _env():
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _layout():
    return ArenaLayout(n_layer=3, n_expert=8, host_per_layer=4, n_staging=2, slot=SlotLayout.for_parts((9000, 9000, 9000)))


def test_fd_passed_to_another_process_shares_the_bytes():
    lay = _layout()
    arena = Arena.create(lay.total_bytes)
    d = SlotDirectory(arena, lay, create=True)
    d.set(1, 3, TIER_VRAM, 2)
    d.set(0, 0, TIER_HOST, 0)
    off = lay.host_slot_offset(1, 2)
    arena.numpy(off, 4096)[:] = np.arange(4096) % 251
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(child.fileno())], pass_fds=[child.fileno()], env=_env())
    try:
        child.close()
        send_fds(parent, [arena.fd], {"nbytes": arena.nbytes, "layout": lay.to_dict()})
        ok, entry, tier_sum, epoch, pid, active = eval(parent.recv(4096).decode())
        assert ok, "the worker saw other bytes than the store wrote"
        assert entry == (TIER_VRAM, 2, 1)
        assert tier_sum == TIER_VRAM + TIER_HOST and epoch == d.epoch == 4
        assert pid == os.getpid() and active is False
        assert np.all(arena.numpy(off + 4096, 4096) == 7), "the store did not see the worker's write"
        parent.sendall(b"x")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        parent.close()
    # the worker is gone; the arena and its bytes live on (a restarted worker re-attaches)
    assert np.all(arena.numpy(off + 4096, 4096) == 7)
    arena.close()


def test_views_are_zero_copy_and_address_is_the_mapping():
    with Arena.create(3 * 4096 + 1) as a:
        assert a.nbytes == 4 * 4096
        n, t, v = a.numpy(4096, 64), a.torch(4096, 64), a.view(4096, 64)
        t[0] = 9
        v[1] = 10
        assert n[0] == 9 and n[1] == 10
        assert n.ctypes.data == a.address() + 4096 == t.data_ptr()
        assert a.address() % 4096 == 0
        assert register_pinned(a) is False  # no CUDA here: a no-op
        del n, t, v
    assert a.fd == -1


def test_close_with_live_view_keeps_view_valid():
    a = Arena.create(8192)
    v = a.numpy(0, 8192)
    v[:] = 3
    a.close()  # the mapping must outlive the view, not segfault it
    assert int(v.sum()) == 3 * 8192


def test_recv_fds_on_closed_socket_is_a_clear_error():
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(StoreUnavailableError):
        recv_fds(a)
    a.close()


def test_directory_rules():
    lay = _layout()
    with Arena.create(lay.total_bytes) as arena:
        d = SlotDirectory(arena, lay, create=True)
        assert d.lookup(2, 7) == (TIER_DISK, -1, 0)
        d.set(2, 7, TIER_HOST, 3)
        assert d.lookup(2, 7) == (TIER_HOST, 3, 1)
        d.set(2, 7, TIER_VRAM, 3)  # promoted to VRAM: same host backing slot, same bytes
        assert d.lookup(2, 7) == (TIER_VRAM, 3, 1)
        d.set(2, 7, TIER_VRAM, 3, rewritten=True)
        assert d.lookup(2, 7)[2] == 2
        with pytest.raises(AssertionError):
            d.set(2, 6, TIER_HOST, 3)  # slot 3 of layer 2 is taken
        d.set(2, 7, TIER_DISK, -1)
        assert d.lookup(2, 7) == (TIER_DISK, -1, 3)
        assert list(d.host_slots_of(2)) == [-1, -1, -1, -1]
        d.set(2, 6, TIER_HOST, 3)
        assert list(d.host_slots_of(2)) == [-1, -1, -1, 6]
        d.pass_active = True
        with pytest.raises(AssertionError, match="frozen"):
            d.set(0, 0, TIER_HOST, 0)
        d.pass_active = False
        reader = SlotDirectory(arena, lay, create=False)
        with pytest.raises(AssertionError):
            reader.set(0, 0, TIER_HOST, 0)
        with pytest.raises(AssertionError):  # a different geometry does not attach
            SlotDirectory(arena, ArenaLayout(3, 8, 3, 2, lay.slot), create=False)


def test_snapshot_never_sees_half_a_batch():
    """A writer thread flips all of layer 0 between host and VRAM in batches; every snapshot must
    show one tier for the whole layer (the epoch sequence lock)."""
    lay = _layout()
    with Arena.create(lay.total_bytes) as arena:
        d = SlotDirectory(arena, lay, create=True)
        stop = threading.Event()

        def writer():
            k = 0
            while not stop.is_set():
                with d.batch():
                    for e in range(lay.host_per_layer):
                        d.set(0, e, TIER_HOST if k % 2 else TIER_VRAM, e)
                k += 1

        t = threading.Thread(target=writer)
        t.start()
        try:
            r = SlotDirectory(arena, lay, create=False)
            seen = set()
            for _ in range(3000):
                tiers = r.snapshot()["tier"][0, : lay.host_per_layer]
                assert len(set(tiers.tolist())) == 1, tiers
                seen.add(int(tiers[0]))
        finally:
            stop.set()
            t.join()
        assert seen == {TIER_HOST, TIER_VRAM} or len(seen) == 1  # both usually; never mixed


# -- the pre-fault charges the creator's cgroup ------------------------------------------------
CHARGE_CHILD = textwrap.dedent(
    """
    import sys
    import betelgeuse.store.arena as arena_mod
    if sys.argv[2] == "touch":
        arena_mod.MADV_POPULATE_WRITE = 0x7FFF  # an advice the kernel refuses: the touch-per-page fallback
    print("ready", flush=True); sys.stdin.readline()
    a = arena_mod.Arena.create(int(sys.argv[1]), prefault=sys.argv[2] != "none")
    print("created", flush=True); sys.stdin.readline()
    """
)


def _cgroup_or_skip(limit):
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    if CgroupMemory.of_process() is None:
        pytest.skip("no memory cgroup controller")
    try:
        return make_cgroup(f"bg-test-arena-{os.getpid()}", limit)
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here: {e}")


@pytest.mark.parametrize("prefault", ["madvise", "touch", "none"])
def test_prefault_charges_the_creating_cgroup(prefault):
    size = 96 * MiB
    cg = _cgroup_or_skip(512 * MiB)
    proc = subprocess.Popen([sys.executable, "-c", CHARGE_CHILD, str(size), prefault],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    try:
        from betelgeuse.store.cgroup import move_pid

        move_pid(cg, proc.pid)
        assert proc.stdout.readline().strip() == "ready"
        before = cg.current()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "created"
        grew = cg.current() - before
        proc.stdin.write("bye\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
        assert cg.oom_kills() == 0
        if prefault != "none":
            assert 0.95 * size <= grew <= size + 16 * MiB, f"pre-fault charged {grew / MiB:.1f} MiB for {size / MiB} MiB"
        else:
            assert grew < 16 * MiB, f"an untouched arena charged {grew / MiB:.1f} MiB"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remove_cgroup(cg)


def test_unplanned_over_budget_prefault_is_oom_killed_control():
    """Control for test_cgroup's refusal test: without plan_memory, pre-faulting a 256 MiB arena in
    a 128 MiB cgroup without swap is an OOM kill at start-up (not later, mid-run)."""
    cg = _cgroup_or_skip(128 * MiB)
    if cg.swap_limit() != 0:
        remove_cgroup(cg)
        pytest.skip("swap is not accounted in this cgroup; the kernel could swap instead of killing")
    proc = subprocess.Popen([sys.executable, "-c", CHARGE_CHILD, str(256 * MiB), "madvise"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    try:
        from betelgeuse.store.cgroup import move_pid

        move_pid(cg, proc.pid)
        assert proc.stdout.readline().strip() == "ready"
        out, _ = proc.communicate("go\n", timeout=60)
        assert proc.returncode == -9 and "created" not in out
        assert cg.oom_kills() == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remove_cgroup(cg)
