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


class StopSignals:
    """The stop signals' relay (module doc). `got`: the stop signals in arrival order (the caller reads got[0] to say
    which one stopped it). Other signals with Python handlers of their own (SIGHUP's) write their byte too; the relay
    skips them, and their handlers run as before. close(): the wakeup fd off and the relay thread ended (a process that
    goes on after its serve: the CLI's in-process callers, tests)."""

    def __init__(self, stop: threading.Event, signals=(signal.SIGTERM, signal.SIGINT)):
        self.stop, self.wanted, self.got = stop, {int(s) for s in signals}, []
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)     # a full pipe drops the byte rather than block the C handler
        signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)       # main thread only, as signal.signal
        for s in signals:
            signal.signal(s, _ignore)
        threading.Thread(target=self._relay, name="signals", daemon=True).start()

    def _relay(self):
        try:
            while True:
                try:
                    data = os.read(self._r, 256)
                except InterruptedError:
                    continue
                if not data:                # close(): the write end is gone
                    return
                for b in data:
                    if b in self.wanted:
                        self.got.append(b)
                        self.stop.set()
        finally:
            os.close(self._r)

    def close(self):
        if self._w < 0:
            return
        old = signal.set_wakeup_fd(-1)      # main thread only
        if old not in (self._w, -1):        # someone else's since: put it back
            signal.set_wakeup_fd(old)
        os.close(self._w)
        self._w = -1


def stop_on_signals(stop: threading.Event, signals=(signal.SIGTERM, signal.SIGINT)) -> StopSignals:
    """Install the handlers and the relay (main thread only); see StopSignals."""
    return StopSignals(stop, signals)
