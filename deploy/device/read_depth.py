"""How fast one decode step's misses come off the disk, by piece size and reader threads (issue 24/21).

A decode step reads 1-8 experts after each layer's routing; the bench's disk sample reads ~50 at once. This times
`ExpertReader.read` of N random expert-sized ranges (O_DIRECT, the store's reader) for several request sizes and thread
counts, and prints GB/s per case beside the deep sample, so the piece size that keeps a few-expert read near the disk's
rate is measured, not guessed.

    python3 deploy/device/read_depth.py FILE [--expert-mib 4.79] [--out read_depth.md]
FILE: any large file on the disk under test (>= 4 GiB; written, not fallocated: unwritten extents read as zeros).
"""
from __future__ import annotations

import argparse
import random
import time

from betelgeuse.store.arena import Arena
from betelgeuse.store.reader import PAGE, ExpertReader


def run(path: str, expert: int, n: int, threads: int, req: int, reps: int, seed: int) -> tuple[float, float]:
    slot = -(-(expert + 2 * PAGE) // PAGE) * PAGE
    arena = Arena.create(n * slot, name="bg-read-depth")
    rd = ExpertReader(path, arena, threads=threads, request_bytes=req)
    rng = random.Random(seed)
    size = rd.file_size
    try:
        lat = []
        total = 0
        t_all = time.perf_counter()
        for _ in range(reps):
            ranges = [(rng.randrange(0, size - expert - PAGE) // PAGE * PAGE + 96, expert, i * slot)
                      for i in range(n)]
            t = time.perf_counter()
            rd.read(ranges).result()
            lat.append(time.perf_counter() - t)
            total += n * expert
        dt = time.perf_counter() - t_all
        lat.sort()
        return total / dt / 1e9, lat[len(lat) // 2] * 1e3
    finally:
        rd.close()
        arena.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--expert-mib", type=float, default=4.79)
    ap.add_argument("--experts", default="1,2,4,8,48")
    ap.add_argument("--threads", default="8,16,32")
    ap.add_argument("--request-kib", default="4096,1024,512,256,128")
    ap.add_argument("--bytes", type=float, default=0.6e9, help="bytes per case")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    expert = int(a.expert_mib * 2**20)
    lines = [f"# read depth: {a.file}, expert {a.expert_mib} MiB", "",
             "| experts per read | threads | request KiB | GB/s | median ms per read |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    seed = 0
    for n in map(int, a.experts.split(",")):
        for th in map(int, a.threads.split(",")):
            for kib in map(int, a.request_kib.split(",")):
                seed += 1
                reps = max(3, int(a.bytes // (n * expert)))
                gbs, ms = run(a.file, expert, n, th, kib * 1024, reps, seed)
                line = f"| {n} | {th} | {kib} | {gbs:.2f} | {ms:.2f} |"
                lines.append(line)
                print(line, flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
