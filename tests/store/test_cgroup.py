"""Budgets from the real cgroup of this machine (v1 here, v2 on the GPU machine)."""

import os
import subprocess
import sys
import textwrap

import pytest

from betelgeuse.errors import BudgetError
from betelgeuse.store.cgroup import CgroupMemory, make_cgroup, move_pid, plan_memory, remove_cgroup

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB, GiB = 1 << 20, 1 << 30


def _own_memory_line():
    """The memory cgroup path of this process as /proc/self/cgroup states it (read independently)."""
    v1 = v2 = None
    for line in open("/proc/self/cgroup").read().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            v1 = path
        elif hid == "0":
            v2 = path
    return v1, v2


def test_of_process_parses_this_machine():
    cg = CgroupMemory.of_process()
    if cg is None:
        pytest.skip("no memory cgroup controller")
    v1, v2 = _own_memory_line()
    assert cg.version in (1, 2) and os.path.isdir(cg.path)
    want = v1 if cg.version == 1 else v2
    assert cg.path.rstrip("/").endswith(want.rstrip("/")), (cg.path, want)
    usage_file = "memory.usage_in_bytes" if cg.version == 1 else "memory.current"
    assert os.path.exists(os.path.join(cg.path, usage_file))
    assert cg.current() > 0
    assert cg.oom_kills() >= 0
    lim = cg.limit()
    assert lim is None or lim > cg.current()
    peak = cg.peak()
    assert peak is None or peak >= 0
    assert CgroupMemory.of_process(os.getpid()) == cg


def _make_or_skip(name, limit):
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    if CgroupMemory.of_process() is None:
        pytest.skip("no memory cgroup controller")
    try:
        return make_cgroup(name, limit)
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here: {e}")


def test_make_move_remove_round_trip():
    cg = _make_or_skip(f"bg-test-rt-{os.getpid()}", 256 * MiB)
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert cg.created and os.path.isdir(cg.path)
        assert cg.limit() == 256 * MiB  # the minimum over the chain; our parents allow more
        limit_file = "memory.limit_in_bytes" if cg.version == 1 else "memory.max"
        assert int(open(os.path.join(cg.path, limit_file)).read()) == 256 * MiB
        assert cg.swap_limit() in (0, None)  # 0 where swap is accounted
        move_pid(cg, sleeper.pid)
        assert CgroupMemory.of_process(sleeper.pid).path == cg.path
        assert cg.pids() == [sleeper.pid]
    finally:
        remove_cgroup(cg)  # moves the sleeper back out first
        sleeper.stdin.close()
        sleeper.wait(timeout=30)
    assert not os.path.exists(cg.path)
    assert sleeper.returncode == 0
    with pytest.raises(AssertionError, match="did not create"):
        remove_cgroup(CgroupMemory.of_process())


# A store that checks its budget before creating the arena. If plan_memory let it through, the
# pre-fault of a 1 GiB arena in a 256 MiB cgroup without swap would get it OOM-killed.
STORE_CHILD = textwrap.dedent(
    """
    import sys
    from betelgeuse.errors import BetelgeuseError
    from betelgeuse.store.cgroup import CgroupMemory, plan_memory
    sys.stdin.readline()                                 # wait until moved into the cgroup
    cg = CgroupMemory.of_process()
    try:
        plan_memory(cg.limit(), cg.current(), arena_bytes=1 << 30, worker_reserve=0, headroom=16 << 20)
    except BetelgeuseError as e:
        print(f"betelgeuse: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    from betelgeuse.store.arena import Arena
    Arena.create(1 << 30)
    print("arena created", flush=True)
    """
)


def test_over_budget_arena_is_refused_not_oom_killed():
    cg = _make_or_skip(f"bg-test-budget-{os.getpid()}", 256 * MiB)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", STORE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        move_pid(cg, proc.pid)
        out, err = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 2, (proc.returncode, out, err)
        assert err.startswith("betelgeuse: error: memory budget exceeded") and "Traceback" not in err, err
        assert "arena 1.00 GiB (1073741824 bytes)" in err and "cgroup limit 0.25 GiB (268435456 bytes)" in err, err
        assert cg.oom_kills() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remove_cgroup(cg)


def test_plan_memory_arithmetic():
    plan_memory(None, 5 * GiB, 100 * GiB, 0, 0)  # unlimited
    plan_memory(12 * GiB, 1 * GiB, 9 * GiB, 1 * GiB, 1 * GiB)  # exactly fits
    with pytest.raises(BudgetError) as e:
        plan_memory(12 * GiB, 1 * GiB, 9 * GiB, 1 * GiB, 1 * GiB + 1)
    msg = str(e.value)
    assert "\n" not in msg and "cgroup limit 12.00 GiB (12884901888 bytes)" in msg and "(1 bytes)" in msg
