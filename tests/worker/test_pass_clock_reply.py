"""PassClock.reply (worker/stats.py, issue 21): a BeginPass / EndPass message's wait for the store's reply is blocked
time, only the calling thread's CPU time in it is the message's host time."""

import time

import torch

from betelgeuse.worker.stats import PassClock, PassStats


def _spin(seconds: float):
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def _cpu_spin(seconds: float):
    """Spin until this thread has used `seconds` of CPU: on a busy machine a wall-clock spin may get a fraction of
    its wall as CPU (CI saw 4.7 ms of a 20 ms spin), so the host time it stands for must be CPU time."""
    c = time.thread_time()
    while time.thread_time() - c < seconds:
        pass


def test_reply_wait_is_blocked_and_cpu_is_host():
    clock = PassClock(torch.device("cpu"))
    clock.begin()
    # a reply the thread sleeps for (the store's work: off this thread's CPU), then the client's own work (on it)
    t0 = time.perf_counter()
    clock.reply("end_pass", lambda: (time.sleep(0.05), _cpu_spin(0.02)))
    wall = time.perf_counter() - t0
    clock.message("load", _spin, 0.01)                 # an ordinary message: all of it host, as before
    st = PassStats("decode", "layer_major", 1)
    clock.finish(st)
    n, host = st.store_rpc["end_pass"]
    assert n == 1
    # the sleep is blocked, the spin is host (20 ms of CPU; where a busy machine preempts it, the wall it waits is
    # blocked too)
    assert st.store_reply_wait_s >= 0.045, st.store_reply_wait_s
    assert 0.0195 <= host <= wall - 0.045, (host, wall)
    assert abs(host + st.store_reply_wait_s - wall) < 0.005, (host, st.store_reply_wait_s, wall)
    assert st.blocked_s == st.store_reply_wait_s
    assert st.store_rpc["load"][1] >= 0.01
    assert abs(st.host_s - (st.seconds - st.blocked_s)) < 1e-9



def test_waits_count_the_ones_the_thread_slept_in():
    """PassStats.store_waits / store_sleeps (issue 21: a decode's host grows with its waits at the same work; is it the
    wake?): every wait for the store's bytes or a reply is counted, and those in which the thread was off its CPU
    >= PassClock.SLEPT_S are sleeps. A wait spent on the CPU (the spin reader's) is no sleep; a preempted spin on a
    busy machine is, so the spins may count a few."""
    clock = PassClock(torch.device("cpu"))
    clock.begin()
    for _ in range(5):
        clock.wait_store(time.sleep, 0.005)
    clock.reply("end_pass", time.sleep, 0.005)
    for _ in range(5):
        clock.wait_store(_cpu_spin, 0.002)
    clock.wait(time.sleep, 0.005)                      # a sync's wait: blocked, but not a wait for the store
    st = PassStats("decode", "layer_major", 1)
    clock.finish(st)
    assert st.store_waits == 11
    assert 6 <= st.store_sleeps <= 8, st.store_sleeps
    clock.begin()                                      # a new pass starts from none
    clock.finish(st)
    assert st.store_waits == st.store_sleeps == 0
