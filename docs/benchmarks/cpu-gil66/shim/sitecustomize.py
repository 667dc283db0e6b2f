"""census.py's children only (PYTHONPATH=this folder): every Python thread's kernel name (comm, 15 bytes) set to
"py:" + its Python name as it starts, and the main thread's to "py:main", so that a census of ANOTHER process
(services/bench/threads.py reads /proc, where Python 3.11's threads all carry the process's name) tells the threads
that take the GIL from gRPC's C threads, by name. One prctl a thread, at its start: nothing periodic."""
import ctypes
import threading

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _name(n: str):
    if _prctl is not None:
        _prctl(15, ("py:" + n).encode()[:15], 0, 0, 0)          # PR_SET_NAME: this thread's comm


_boot = threading.Thread._bootstrap_inner


def _named(self):
    n = self.name
    _name(n.split(" (", 1)[1].rstrip(")") if n.startswith("Thread-") and " (" in n else n)
    _boot(self)


threading.Thread._bootstrap_inner = _named
_name("main")
