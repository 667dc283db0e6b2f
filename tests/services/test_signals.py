"""services/signals.py: SIGTERM every half millisecond into a process whose other threads take the stop event's lock
all the time. The stop event is set, the process runs to its end and exits 0 with every signal counted.

The same child with the handler the services had before (`got.append(n); stop.set()` inside the handler) died of
RecursionError and then of the signal, as CI saw `serve` do (test_cli_serve's SIGTERM all through the shutdown): a
handler blocked on the event's lock is interrupted by the next signal, which runs the handler again one frame deeper
(2 of 2 runs on the 2-vCPU dev box; left out here, since reproducing CPython's behaviour is timing-dependent)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    from services.signals import stop_on_signals
    stop = threading.Event()
    got = stop_on_signals(stop).got
    hups = []
    signal.signal(signal.SIGHUP, lambda *_: hups.append(1))      # another Python handler: its byte is skipped
    def other():                     # threads taking the stop event's lock all the time (a supervisor's waits)
        while True:
            stop.wait(0.00001)
            with stop._cond:
                sum(range(2000))
    for _ in range(3):
        threading.Thread(target=other, daemon=True).start()
    print("ready", flush=True)
    while not stop.wait(0.2):
        pass
    first = got[0]
    t = time.monotonic()
    while time.monotonic() - t < 2.0:        # the shutdown: signals keep coming
        time.sleep(0.001)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0.05)                         # the relay's last bytes
    print("done", first, len(got), len(hups), flush=True)
""")


def test_stop_signals_hammered_through_the_shutdown_exit_0():
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-c", CHILD], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGHUP)
        sent, t = 0, time.monotonic()
        while p.poll() is None and time.monotonic() - t < 30:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            sent += 1
            time.sleep(0.0005)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    done, first, n, hups = out.split()[-4:]
    assert done == "done" and int(first) == signal.SIGTERM
    assert 1 <= int(n) <= sent and int(hups) == 1, out       # signals of one kind may merge, none invented


def test_close_ends_the_relay_and_gives_the_wakeup_fd_back():
    """In-process (serve run by a caller that goes on): close() turns the wakeup fd off and the relay thread ends."""
    import os
    import threading
    from services.signals import stop_on_signals
    was = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = threading.Event()
    try:
        sig = stop_on_signals(stop)
        relay = next(t for t in threading.enumerate() if t.name == "signals")
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5) and sig.got == [signal.SIGINT]
        sig.close()
        relay.join(5)
        assert not relay.is_alive() and signal.set_wakeup_fd(-1) == -1
    finally:
        for s, h in was.items():
            signal.signal(s, h)
