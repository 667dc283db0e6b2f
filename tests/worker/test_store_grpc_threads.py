"""The worker's gRPC store client in decode's miss path (issue 21): no thread started per message, and the messages,
answers and failures those messages had with grpc's own futures and streams.

grpc's streams and futures start a channel spin thread whenever the channel's calls in flight drop to none: one
thread start per miss layer's Load in decode. services/grpc/store_client.py sends loads, reads ahead and releases as
messages on one long-lived stream per session (store.proto `Session`: a call always in flight), its answers read by
the caller that waits for one. Checked here:

- a decode with misses through a `services.store_main` child gives the bits, per-step PassStats (tier counts, guess
  counters, messages per kind; not disk_bytes, which the two modes count apart on main as well: 0 for an expert
  staged before the store's pass) and store messages (keys, read-ahead keys, drop lists, in order) of the same decode
  over the in-process store (InProcessStoreClient: no gRPC), every message's reads landed before the worker goes on
  (so the answers do not depend on the reads' timing); and no thread is started in its decode steps, though Loads
  and reads ahead are sent (on grpc's futures every Load started one);
- both checks on each session transport (store.session_transport: grpc, seqpacket; a SEQPACKET stream's reader
  thread starts with its first message, in the prompt's pass, none later);
- the one-way messages' failures: a Release or Prefetch the store refuses raises the worker's error (not a gRPC
  one) from the next call that reaps or from its answer; abort() fails what is in flight with its reason.
"""

from __future__ import annotations

import threading
from dataclasses import fields

import pytest
import torch

from engine_helpers import ENGINE_SPEC, prompt, write_synth
from test_decode_host_fast import TIMING, record_messages

from betelgeuse.config import EngineConfig
from betelgeuse.errors import BetelgeuseError, StoreUnavailableError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("grpcthreads") / "engine.gguf", **ENGINE_SPEC)


def _decode(path, mode: str, monkeypatch, steps: int = 16, transport: str = "grpc"):
    """A prompt, the store settled, `steps` greedy decode steps in the static form with few slots (2 VRAM + 3 host of
    32 experts: most layers miss) -> (logits [steps, V], per step the observables, the messages, thread starts in
    the steps)."""
    from services.assembly import open_runner, open_store
    monkeypatch.undo()
    cfg = EngineConfig(model_path=str(path), vram_slots=2, host_slots=3, read_threads=1, decode_at_hand=True,
                       decode_consolidate_every=0)
    store = open_store(cfg, mode) if mode == "in-process" else open_store(cfg, mode, session_transport=transport)
    rn = None
    try:
        rn = open_runner(cfg, store)
        client = rn.session.store
        sent = record_messages(monkeypatch, client, client)
        V = rn.mcfg.n_vocab
        kv = rn.new_cache(128)
        lg, _ = rn.forward(prompt(48, V, seed=7), kv)
        rn.settle()
        rn._static_decode = True
        sent.clear()
        starts = [0]
        start = threading.Thread.start

        def counted(self, *a, **k):
            starts[0] += 1
            return start(self, *a, **k)
        monkeypatch.setattr(threading.Thread, "start", counted)
        tok = int(lg[-1].argmax())
        out, seen = [], []
        for _ in range(steps):
            lg, s = rn.forward([tok], kv, consolidate=False)
            lg = lg.reshape(-1, V)[-1]
            row = {f.name: getattr(s, f.name) for f in fields(s) if f.name not in TIMING | {"disk_bytes"}}
            row["store_rpc"] = {k: v[0] for k, v in s.store_rpc.items()}
            row["layers"] = [(x.vram, x.host, x.disk, x.synced, x.groups) for x in s.layers]
            seen.append(row)
            out.append(lg)
            tok = int(lg.argmax())
        monkeypatch.setattr(threading.Thread, "start", start)
        return torch.stack(out), seen, sent, starts[0]
    finally:
        if rn is not None:
            rn.close()
        store.close()


@pytest.mark.parametrize("transport", ["grpc", "seqpacket"])
def test_a_decode_with_misses_through_the_store_process_is_the_in_process_one(model, monkeypatch, transport):
    want, ref, ref_sent, _ = _decode(model, "in-process", monkeypatch)
    got, seen, sent, starts = _decode(model, "process", monkeypatch, transport=transport)
    assert torch.equal(got, want), (got - want).abs().max().item()
    for i, (a, b) in enumerate(zip(seen, ref)):
        assert a == b, (i, {k: (a[k], b[k]) for k in a if a[k] != b[k]})
    assert sent == ref_sent, ([(i, x, y) for i, (x, y) in enumerate(zip(sent, ref_sent)) if x != y][:3],
                              len(sent), len(ref_sent))
    kinds = [m[0] for m in sent]
    # the miss path ran: layers read from disk, a Load per miss layer, reads ahead of guesses sent
    assert sum(r["reads"]["disk"] for r in seen) > 10 and kinds.count("load") > 10, (kinds, seen[0]["reads"])
    assert any(m[0] == "load" and m[1][2] for m in sent) or "prefetch_start" in kinds, sent[:4]
    assert starts == 0, f"{starts} threads started in {len(seen)} decode steps ({len(sent)} store messages)"


@pytest.mark.parametrize("transport", ["grpc", "seqpacket"])
def test_one_way_messages_fail_as_the_workers_errors(model, transport):
    """Release and Prefetch sent without waiting: a refusal (an unknown session) raises StoreUnavailableError from
    the next call that reaps (release, begin_pass) or from the answer (prefetch_start's queued()); after abort() a
    message in flight fails with abort()'s reason, and a new one with it too."""
    from services.assembly import open_store
    cfg = EngineConfig(model_path=str(model), vram_slots=2, host_slots=3, read_threads=1)
    store = open_store(cfg, "process", session_transport=transport)
    try:
        c = store.client
        c.attach()
        c.begin_pass(False)
        assert c.prefetch_start([(1, 0)])() >= 0          # answered: the reads started
        c.release([])                                     # answered ok: reaped later without a word
        good, c.session = c.session, "not-a-session"
        c.release([0])
        with pytest.raises(StoreUnavailableError, match="expert store unavailable"):
            c.begin_pass(False)                           # reaps every release first: the refused one raises
        q = c.prefetch_start([(1, 1)])
        with pytest.raises(StoreUnavailableError, match="expert store unavailable"):
            q()
        c.session = good
        q = c.prefetch_start([(1, 2)])
        why = StoreUnavailableError("expert store unavailable: the probe saw it hang")
        c.abort(why)
        try:
            q()                                           # answered before the close, or failed with the reason
        except BetelgeuseError as e:
            assert str(e) == str(why)
        with pytest.raises(StoreUnavailableError, match="the probe saw it hang"):
            c.prefetch_start([(1, 3)])()
        with pytest.raises(StoreUnavailableError, match="the probe saw it hang"):
            list(c.load([(1, 4)]))
    finally:
        store.close()
