"""The prefix cache survives a restart of the WHOLE service ([store] prefix_save_path, store/prefix_disk.py): real store
and worker processes on the tiny model; a prompt served, both stopped with SIGTERM (worker first, as systemd and
`serve` do), both started again: the repeated prompt comes from the host tier the new store loaded from the file, with
the tokens and logprobs of the same prompt computed afresh (another cache_salt) in the same process. With the
setting off nothing is written and the prompt is recomputed. The file format's failure cases (another model or
geometry, truncated, corrupt): tests/store/test_prefix_disk.py."""

from __future__ import annotations

import json

import numpy as np

import service_helpers as h
from service_helpers import service_model  # noqa: F401  (the tiny model, a fixture)

AGENT = [int(x) for x in np.random.default_rng(11).integers(3, 1000, 150)]    # 2 blocks of 64 + 22 tokens


def _final(c, ids, salt=""):
    """(tokens with their logprobs, the final event's usage) of a greedy request."""
    req = h.request(ids=ids, max_tokens=4, ignore_eos=True, cache_salt=salt)
    req.sampling.logprobs = True
    toks, usage = [], None
    with c.channel() as ch:
        for ev in h.stub(ch).Generate(req, timeout=120):
            if ev.WhichOneof("event") == "token":
                toks.append((ev.token.token_id, ev.token.logprob))
            else:
                usage = ev.final.usage
    assert usage is not None
    return toks, usage


def _status(c) -> dict:
    from services.pb.betelgeuse.v1 import store_pb2 as spb
    from services.pb.betelgeuse.v1 import store_pb2_grpc as spb_grpc
    import grpc
    with grpc.insecure_channel(f"unix:{c.store_socket}") as ch:
        return json.loads(spb_grpc.ExpertStoreStub(ch).Status(spb.StatusRequest(), timeout=10).json)


def test_the_prefix_cache_survives_a_restart_of_the_whole_service(service_model, tmp_path):
    path = tmp_path / "state" / "prefix-cache.bin"
    path.parent.mkdir()
    on = {"store.prefix_save_path": str(path)}
    c = h.start_cluster(service_model, tmp_path / "run1", settings=on)
    try:
        first, usage = _final(c, AGENT)
        assert usage.cached_tokens == 0
    finally:
        assert c.stop() == 0, h.cluster_logs(c)
    assert path.stat().st_size > 0, h.cluster_logs(c)
    c = h.start_cluster(service_model, tmp_path / "run2", settings=on)
    try:
        st = _status(c)
        assert st["prefix_loaded_entries"] >= 3, (st, c.store.log()[-2000:])   # the agent's 2 blocks + its whole
        again, usage = _final(c, AGENT)
        fresh, fusage = _final(c, AGENT, salt="fresh")           # the same prompt computed anew, in the same worker
        assert usage.cached_tokens == len(AGENT), (usage, h.cluster_logs(c))
        assert fusage.cached_tokens == 0
        assert again == fresh and [t for t, _ in again] == [t for t, _ in first], (again, fresh, first)
        samples = h.scrape(c.store_metrics_url)
        assert h.value(samples, "betelgeuse_prefix_loaded_entries") == st["prefix_loaded_entries"]
    finally:
        assert c.stop() == 0, h.cluster_logs(c)


def test_with_the_setting_off_nothing_is_written_and_the_prompt_is_recomputed(service_model, tmp_path):
    for run in ("run1", "run2"):
        c = h.start_cluster(service_model, tmp_path / run, settings={"store.prefix_save_path": ""})
        try:
            assert "prefix_save_path" not in _status(c)
            _, usage = _final(c, AGENT)
            assert usage.cached_tokens == 0, usage           # a new store: a new, empty host tier
        finally:
            assert c.stop() == 0, h.cluster_logs(c)
        assert "prefix_save" not in c.store.log() and "prefix_load" not in c.store.log()
    assert not [p for p in tmp_path.rglob("*") if "prefix" in p.name]
