"""Stop signals (SIGTERM, SIGINT) as a `threading.Event`, set by a thread of ours, never inside the signal handler.

Why not `signal.signal(SIGTERM, lambda *_: stop.set())`: Python runs a handler in the main thread between two
bytecodes of whatever that thread is doing, and `Event.set()` takes the event's condition lock (a plain, non-reentrant
Lock). If the interrupted code holds that lock (the main thread inside `stop.wait()` between entering the condition
and releasing it to wait, or inside an earlier handler's `stop.set()`), the handler blocks on its own thread's lock
for good; each further signal interrupts that blocked acquire, runs the handler again one frame deeper and blocks
again. CI saw it: `serve` sent SIGTERM every millisecond through its shutdown died of RecursionError, then of the
signal (tests/services/test_cli_serve.py, SIGTERM all through the shutdown).

Here the C-level handler writes the signal's number to a pipe (`signal.set_wakeup_fd`: async-signal-safe, no Python
runs for it), the Python-level handler does nothing, and a daemon thread blocked on the pipe's read end records the
signal and sets the event like any other thread would. The thread wakes only when a signal arrives: no polling, no
periodic wakeup taking the process's GIL.
"""

from __future__ import annotations

import os
import signal
import threading


def _ignore(_signum, _frame):       # a Python-level handler must exist for the C handler to write the wakeup byte
    pass


def stop_on_signals(stop: threading.Event, signals=(signal.SIGTERM, signal.SIGINT)) -> list[int]:
    """Install the handlers (main thread only, as `signal.signal`); returns the list the stop signals are appended to,
    in arrival order (the caller reads got[0] to say which one stopped it). Other signals with Python handlers of
    their own (SIGHUP's) write their byte too; the relay skips them, and their handlers run as before."""
    wanted = {int(s) for s in signals}
    got: list[int] = []
    r, w = os.pipe()
    os.set_blocking(w, False)           # a full pipe drops the byte rather than block the C handler
    os.set_inheritable(r, False)
    os.set_inheritable(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for s in signals:
        signal.signal(s, _ignore)

    def relay():
        while True:
            try:
                data = os.read(r, 256)
            except InterruptedError:
                continue
            if not data:
                return
            for b in data:
                if b in wanted:
                    got.append(b)
                    stop.set()
    threading.Thread(target=relay, name="signals", daemon=True).start()
    return got
