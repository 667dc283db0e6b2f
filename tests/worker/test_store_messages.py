"""Store messages per decode token through a real store process (gRPC on a Unix socket; worker/moe_step.py).

A decode layer with a miss sends the store ONE message (its Load: the staging slots of earlier layers handed back,
its demand loads, the next layer's guessed experts read ahead once its reads have started); a layer without a miss
sends none, or one read ahead of guessed experts; a deepseek4 step sends one more read ahead at its start (its
hash-routed layers' experts of its token: MoEStep.hash_ahead). Every message is counted as the client sends it (the
unary calls by an interceptor that never waits for a reply; a load, prefetch or release as the client puts it on the
session's stream, by kind) and compared with the pass's own count (PassStats); no staging slot stays held once the
request is done.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest

from engine_helpers import prompt, write_tiny_pair

STEPS = 6
PER_LAYER = ("Load", "Prefetch", "Release")        # the messages of a pass's layers (BeginPass/EndPass open and close)


class MethodCounter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Messages sent on a channel, by method, without waiting for any reply; watch(client): the requests the client
    puts on its session stream, by the method each was before the stream (Load, Prefetch, Release)."""

    STREAMED = {"load": "Load", "prefetch": "Prefetch", "release": "Release"}

    def __init__(self):
        self.sent = Counter()

    def watch(self, client):
        send = client._send

        def counted(kind, *a, **kw):
            self.sent[self.STREAMED[kind]] += 1
            return send(kind, *a, **kw)
        client._send = counted

    def intercept_unary_unary(self, continuation, details, request):
        self.sent[details.method.rsplit("/", 1)[-1]] += 1
        return continuation(details, request)

    def intercept_unary_stream(self, continuation, details, request):
        self.sent[details.method.rsplit("/", 1)[-1]] += 1
        return continuation(details, request)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("messages"))


@pytest.mark.parametrize("arch,guess", [("qwen3moe", True), ("qwen3moe", False), ("deepseek4", True)])
def test_one_message_per_decode_layer_with_a_miss(models, tmp_path, arch, guess):
    from betelgeuse.config import EngineConfig
    from services.assembly import open_runner, open_store
    cfg = EngineConfig(model_path=str(models[arch]), vram_slots=1, host_slots=2, read_threads=2,
                       prefetch_decode=guess, prefetch_hash=True)        # its step-start message counted too
    store = open_store(cfg, "process", str(tmp_path / "store"), timeout=120.0)
    try:
        rn = open_runner(cfg, store)
        client = store.client
        counter = MethodCounter()
        client.bind(grpc.intercept_channel(client.channel, counter))
        counter.watch(client)
        n_vocab, L = rn.mcfg.n_vocab, rn.mcfg.n_layer
        kv = rn.new_cache(64)
        logits, _ = rn.forward(prompt(20, n_vocab, seed=3), kv)
        rn.settle()                        # the prefill's consolidation applied: decode passes stay open
        tok = int(logits[-1].argmax())
        missed = guessed = hashed = 0
        for _ in range(STEPS):
            before = counter.sent.copy()
            logits, st = rn.forward([tok], kv, consolidate=False)
            tok = int(logits[-1].argmax())
            sent = counter.sent - before
            miss = sum(1 for ls in st.layers if ls.disk)
            # every message the channel sent is one the pass counted, by kind
            assert sum(sent.values()) == st.store_calls, (sent, st.store_rpc)
            assert {k: n for k, (n, _) in st.store_rpc.items() if n} == {
                {"Load": "load", "Prefetch": "prefetch", "Release": "release", "BeginPass": "begin_pass",
                 "EndPass": "end_pass"}[k]: n for k, n in sent.items()}
            assert sent["Load"] == miss, (sent, miss)             # one per layer with a miss
            assert sent["Release"] == 0, sent                      # slots go back with the next message
            # deepseek4: one read ahead at the step's start for its hash-routed layers (MoEStep.hash_ahead)
            ahead = 1 if st.hash_ahead else 0
            assert sent["Prefetch"] <= L - miss + ahead, (sent, miss)     # guesses alone: where no Load carries them
            assert sum(sent[k] for k in PER_LAYER) <= L + ahead
            hashed += ahead
            missed += miss
            guessed += st.guessed
        assert missed > 0, "the decode never missed: the test measures nothing"
        assert (guessed > 0) == guess
        assert (hashed > 0) == (arch == "deepseek4")
        rn.request_done(kv, others_running=False)
        assert client.status()["staging_handed"] == 0     # every staging slot handed back
        rn.close()
    finally:
        store.close()
