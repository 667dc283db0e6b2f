"""Eight clients arriving together at a real engine (tiny synth model, CPU): one prefill pass for all of them, every
first token before anyone's third, and each request's tokens and logprobs the bits of its solo run (DESIGN.md §2,
batch invariance). The policy alone, on a fake clock, is in test_scheduler.py; this is the engine carrying it out:
the admission window's wait on the engine's condition, the scheduler's plan, the runner's passes."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from betelgeuse.api import GenerateRequest, SamplingParams
from betelgeuse.config import EngineConfig

from engine_helpers import ENGINE_SPEC, prompt, write_synth

V = ENGINE_SPEC["n_vocab"]
C = 8                               # prefill_chunk
N = 8                               # clients
WINDOW = 2.0                        # wide (a loaded 2-core CI runner may be slow to start eight threads) and free:
                                    # admission starts as soon as max_running = 8 wait


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("burst") / "engine.gguf", **ENGINE_SPEC)


def _req(ids, n=4):
    return GenerateRequest(prompt_ids=ids, max_tokens=n, ignore_eos=True,
                           sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))


def _toks(events):
    return [(e.token_id, e.logprob, tuple(e.top_logprobs)) for e in events[:-1]]


def test_a_burst_of_eight_shares_one_prefill_pass_fairly_and_exactly(model):
    """max_batched_tokens = one chunk: beside running decodes a prefill pass takes 8 tokens (while none run, up to
    max_context = 256: the burst's 156 fit one pass), so a request that
    started alone would decode while the others are prefilled 8 tokens a step. The window gathers the burst (2 ms
    apart) into one pass while nothing runs; it fails without it (admission_window 0: the first arrival's pass runs
    alone, the rest follow in pieces and the first request's 3rd token comes before their first)."""
    from betelgeuse.assembly import open_engine, open_store
    cfg = EngineConfig(model_path=str(model), vram_slots=5, host_slots=15, read_threads=2, prefill_chunk=C,
                       max_running=N, max_batched_tokens=C, max_context=256, prefix_cache_bytes=0,
                       admission_window=WINDOW)
    store = open_store(cfg)
    eng = open_engine(cfg, store)
    prompts = [prompt(16 + i, V, seed=200 + i) for i in range(N)]
    try:
        window = eng.scheduler.limits
        eng.scheduler.limits = dataclasses.replace(window, admission_window=0.0)    # solo runs start at once
        solo = [_toks(list(eng.submit(_req(P)))) for P in prompts]
        eng.scheduler.limits = window

        passes, order = [], []
        eng.on_pass = lambda st: passes.append((st.kind, st.n_tokens))
        real_token = eng.outputs.token

        def token(seq, logits):                     # on the engine thread, in emission order
            fin = real_token(seq, logits)
            order.append((seq.seq_id, len(seq.out_ids)))
            return fin
        eng.outputs.token = token

        got: list = [None] * N
        go = threading.Barrier(N)

        def client(i):
            go.wait()
            time.sleep(0.002 * i)                   # they reach the engine milliseconds apart, as over HTTP
            got[i] = list(eng.submit(_req(prompts[i])))
        threads = [threading.Thread(target=client, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(g is not None for g in got)
        assert [_toks(g) for g in got] == solo, "a request's tokens or logprobs differ from its solo run"

        prefills = [n for kind, n in passes if kind == "prefill"]
        assert prefills == [sum(map(len, prompts))], passes           # ONE pass for every prompt of the burst
        firsts = [i for i, (_, k) in enumerate(order) if k == 1]
        seconds = [i for i, (_, k) in enumerate(order) if k == 2]
        assert len(firsts) == N and max(firsts) < min(seconds), order       # all from the one pass: before a 2nd
        for g in got:                               # queued until the 8th arrived, not for the whole window
            assert g[-1].usage.queue_ms < 1000 * WINDOW, g[-1].usage
    finally:
        eng.close()
        store.close()
