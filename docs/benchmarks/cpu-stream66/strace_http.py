"""`strace -c` of the live worker's http (event loop), AnyIO worker and engine threads over one streamed /v1/completions
of 64 tokens (census.py's serve, its model): which syscalls each thread makes a token. strace slows the traced
threads, so the wakeup counts are census.py's; this says what they are made of.

    PYTHONPATH=TREE OMP_NUM_THREADS=1 python docs/benchmarks/cpu-stream66/strace_http.py MODEL.gguf OUT_DIR
"""
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import census as C                          # noqa: E402

from services.bench.serve import Client      # noqa: E402
from services.launcher import Cluster        # noqa: E402


def main(model: str, out: str):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = str(C.SHIM)
    c = Cluster(model, str(out / "serve"), device="cpu", http="auto",
                settings={"slots.vram_per_layer": 2, "slots.host_per_layer": 3})
    try:
        c.start_store()
        c.start_worker()
        mid = Client(c.http).get("/v1/models")[1]["data"][0]["id"]
        pid = c.worker.pid
        C.http_raw(c, mid, [3, 4, 5, 6], 4, C.Window({"worker": pid}, 4))          # warm-up
        tids: dict[str, list[str]] = {}
        for t in os.listdir(f"/proc/{pid}/task"):
            tids.setdefault(Path(f"/proc/{pid}/task/{t}/comm").read_text().strip(), []).append(t)
        procs = [subprocess.Popen(["strace", "-c", "-p", t, "-o", str(out / f"{name[3:].replace(' ', '_')}.txt")],
                                  stderr=subprocess.DEVNULL)
                 for name in ("py:http", "py:AnyIO worker", "py:engine") for t in tids.get(name, [])]
        time.sleep(1.0)
        C.http_raw(c, mid, list(range(11, 19)), 64, C.Window({"worker": pid}, 64))
        for p in procs:
            p.send_signal(2)
        for p in procs:
            p.wait(10)
    finally:
        c.stop()
    for f in sorted(out.glob("*.txt")):
        print("==", f.stem)
        print(f.read_text())


if __name__ == "__main__":
    main(*sys.argv[1:3])
