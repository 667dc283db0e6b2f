"""A worker killed with `kill -9` while VRAM experts keep no host copy (`vram_backing = false`, what `auto` picks where
host RAM binds) comes back exact: its VRAM tier is refilled from disk through the store (while the worker idles, or on its first
pass; real store
and worker processes, the tiny model, greedy tokens against the independent in-process reference).

With copies (`tests/services/test_reliability.py::test_kill9_of_the_worker_mid_stream_comes_back_warm`) the first
request after the restart reads nothing from disk; here the store reads the VRAM tier again (the copies are gone), and
the next request far fewer.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

import service_helpers as h
from betelgeuse.gguf.reader import GGUFModelFile
from service_helpers import service_model  # noqa: F401  (the tiny model, a fixture)

PROMPT = [(11 * j) % 1000 + 3 for j in range(9)]
LONG = [(5 * j) % 1000 + 7 for j in range(7)]


@pytest.fixture(scope="module")
def cluster(service_model, tmp_path_factory):
    # 5 VRAM + 11 host slots per layer: all 16 tiny experts resident, none of the VRAM ones with a host copy
    c = h.start_cluster(service_model, tmp_path_factory.mktemp("nobacking") / "run",
                        settings={"slots.vram_backing": False})
    yield c
    c.stop()


def gen(channel, ids, n, salt=""):
    return h.run_stream(h.stub(channel).Generate(h.request(ids=ids, max_tokens=n, ignore_eos=True, cache_salt=salt),
                                                 timeout=120))


def test_kill9_of_the_worker_refills_vram_from_disk_and_stays_exact(cluster, service_model):
    want = h.reference_greedy(service_model, PROMPT, 6, ignore_eos=True)[0]
    f = GGUFModelFile.open(service_model)
    expert = min(f.expert_nbytes(layer) for layer in range(f.config.n_layer))      # one expert's bytes (smallest layer)
    with cluster.channel() as ch:
        mi = h.stub(ch).GetModelInfo(h.pb.GetModelInfoRequest(), timeout=10).model
        assert (mi.plan.vram_backing, mi.plan.vram_backing_requested) == (False, "false")
        assert mi.plan.resident_experts_per_layer == 16 and mi.plan.vram_slots == 5
        reads, disk_bytes = [], []      # per request: expert uses read from disk, bytes read from disk
        for i in range(8):               # until the disk reads per request settle (a new salt: no prefix-cache hit)
            r = gen(ch, PROMPT, 6, f"warm-{i}")
            assert r.code is None and r.tokens == want, (r.code, r.details)
            reads.append(r.final.usage.expert_reads_disk)
            disk_bytes.append(r.final.usage.disk_bytes)
            if len(reads) >= 3 and reads[-1] == reads[-2]:
                break
        # every expert is resident (a swap between VRAM and the full host tier would read the demoted one from disk:
        # store/residency.py keeps VRAM membership sticky, so the reads settle at 0 here)
        steady = reads[-1]
        assert steady < 5 * 4, reads
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=gen(ch, LONG, 1500)))
        t.start()
        time.sleep(1.0)                  # a few tokens in
        cluster.worker.kill9()
        t.join(30)
        assert out["r"].code == grpc.StatusCode.UNAVAILABLE, (out["r"].code, out["r"].details)
    before = h.scrape(cluster.store_metrics_url)
    cluster.start_worker()
    with cluster.channel() as ch:
        r = gen(ch, PROMPT, 6, "after")
        assert r.code is None and r.tokens == want, (r.code, r.details)
        # the store syncs its counters every 0.5 s
        name, want_bytes = "betelgeuse_disk_read_bytes_total", 2 * 4 * expert
        after = h.wait_metric(cluster.store_metrics_url, lambda s: h.delta(before, s, name) >= 5 * 4 * expert)
        read = h.delta(before, after, name)
        # the 5 VRAM experts of each of the 4 layers had no host copy: the store reads the VRAM tier the restarted
        # worker takes again from disk, either for its idle settling (engine: VRAM fills while nothing runs) or at this
        # request's pass start (fills, not uses: the route counts them as VRAM); with copies the store reads ~nothing
        # here. Not always all 20: on the lead's machine (2026-12-06, at this session's base too) the bytes ran from
        # ~14 to 20 experts' worth run to run, as the restarted worker chooses its VRAM set anew. At least two a
        # layer, and more than the steady requests read
        assert read >= want_bytes > disk_bytes[-1], (read, r.final.usage, disk_bytes)
        r = gen(ch, PROMPT, 6, "again")
        assert r.code is None and r.tokens == want
        assert r.final.usage.disk_bytes < 5 * 4 * expert, (r.final.usage, disk_bytes)   # the VRAM tier is not read again
