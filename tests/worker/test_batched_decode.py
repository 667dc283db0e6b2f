"""Continuous batching for decode (issue 11, part): several sequences decode in ONE pass, each expert applied once
per layer to every row that chose it, and each sequence's logits are bit-identical to the same sequence decoded
alone (invariant 6), whatever else shares the batch and whatever the slot configuration."""

import torch

from engine_helpers import ENGINE_SPEC, close_runner, in_process_runner, prompt, write_synth

import pytest

PROMPTS = [prompt(n, ENGINE_SPEC["n_vocab"], seed=s) for n, s in ((40, 3), (17, 5), (29, 7))]
STEPS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("batch") / "engine.gguf", **ENGINE_SPEC)


def _solo(model, P, static=False, lanes=None):
    """P decoded alone for STEPS greedy tokens -> logits [STEPS, n_vocab]. lanes: through decode_batch with one
    sequence (how the engine decodes a lone sequence in the static form) on a runner of that many lanes;
    else runner.forward, one row."""
    rn, st = in_process_runner(model, 0, 0, **({"max_running": lanes} if lanes else {}))
    rn._static_decode = static
    try:
        kv = rn.new_cache(64)
        lg, _ = rn.forward(P, kv)
        out = []
        for _ in range(STEPS):
            tok = int(lg[-1].argmax())
            lg, _ = rn.decode_batch([tok], [kv]) if lanes else rn.forward([tok], kv, consolidate=False)
            out.append(lg[0])
        return torch.stack(out)
    finally:
        close_runner(rn, st)


# static: the CUDA decode form (device-side positions, whole-cache attention) forced on the CPU, so that the batched
# lanes of worker/lanes.py run here too (eagerly: graphs need CUDA; deploy/device/check_cuda.py checks capture and
# replay on the GPU). There a sequence alone is decoded through the same lanes (one sequence, the others idle), and
# the lanes' row-batched ops also agree with forward()'s one-row decode to rounding.
@pytest.mark.parametrize("vram,host,static", [(5, 15, False), (32, 0, False), (5, 15, True)])
def test_batched_decode_equals_solo(model, vram, host, static):
    want = [_solo(model, P, static, lanes=4 if static else None) for P in PROMPTS]
    if static:                                   # the lanes' math against the one-row decode: rounding only
        ref = [_solo(model, P, static) for P in PROMPTS]
        for w, r in zip(want, ref):
            torch.testing.assert_close(w, r, rtol=1e-4, atol=1e-4)
    rn, st = in_process_runner(model, vram, host, max_running=4)
    rn._static_decode = static
    try:
        kvs, last = [], []
        for P in PROMPTS:
            kv = rn.new_cache(64)
            lg, _ = rn.forward(P, kv)
            kvs.append(kv)
            last.append(int(lg[-1].argmax()))
        got = [[] for _ in PROMPTS]
        loads = []
        for step in range(STEPS):
            live = list(range(len(PROMPTS))) if step % 2 == 0 else [0, 2]     # sequence 1 sits out: other batches
            lg, s = rn.decode_batch([last[i] for i in live], [kvs[i] for i in live])
            loads.append((len(live), sum(s.reads.values())))
            for j, i in enumerate(live):
                got[i].append(lg[j])
                last[i] = int(lg[j].argmax())
        # sequence 1 decoded only at even steps: compare what it has
        for i, g in enumerate(got):
            assert torch.equal(torch.stack(g), want[i][:len(g)]), i
        # every expert was applied once per layer for all rows that chose it: fewer applications than rows
        if static:                               # every sequence kept its own lane; a finished one lets go of it
            lanes = rn._lanes
            assert sorted(x.lane for x in lanes.seqs.values()) == [0, 1, 2]
            rn.release(kvs[1])
            assert kvs[1].uid not in lanes.seqs and kvs[0].uid in lanes.seqs
        n, apps = loads[0]
        assert apps < n * ENGINE_SPEC["n_expert_used"] * ENGINE_SPEC["n_layer"]
    finally:
        close_runner(rn, st)


# ---- batched prefill: several prompts in one layer-major pass ------------------------------------------------

def _pieces_alone(path, pieces, vram, host, chunk):
    """Each sequence's pieces by forward() alone on a fresh runner -> per sequence: [all-row logits of each piece],
    then the logits of one decode token after its last piece (reads the KV the pieces wrote)."""
    out = []
    for seq in pieces:
        rn, st = in_process_runner(path, vram, host, prefill_chunk=chunk, max_batched_tokens=max(chunk, 64))
        try:
            kv = rn.new_cache(96)
            got = [rn.forward(p, kv, all_logits=True)[0] for p in seq]
            got.append(rn.forward([int(got[-1][-1].argmax())], kv, consolidate=False)[0])
            out.append(got)
        finally:
            close_runner(rn, st)
    return out


def _pieces_batched(path, pieces, vram, host, chunk):
    """The same pieces, every sequence's first piece alone (sequence 2's, so its next piece starts mid-prompt), then
    the rest in passes that hold one piece of every sequence -> the same layout as _pieces_alone, and the expert
    applications of the first shared pass."""
    rn, st = in_process_runner(path, vram, host, prefill_chunk=chunk, max_batched_tokens=max(chunk, 64),
                               max_running=len(pieces))
    try:
        kvs = [rn.new_cache(96) for _ in pieces]
        out = [[] for _ in pieces]
        out[2].append(rn.forward(pieces[2][0], kvs[2], all_logits=True)[0])
        todo = [list(seq) for seq in pieces]
        todo[2].pop(0)
        apps = None
        while any(todo):
            live = [i for i, t in enumerate(todo) if t]
            lgs, s = rn.prefill_batch([(todo[i].pop(0), kvs[i]) for i in live], all_logits=True)
            apps = sum(s.reads.values()) if apps is None else apps
            for i, lg in zip(live, lgs):
                out[i].append(lg)
        for i, kv in enumerate(kvs):
            out[i].append(rn.forward([int(out[i][-1][-1].argmax())], kv, consolidate=False)[0])
        return out, apps
    finally:
        close_runner(rn, st)


def _check_batched_prefill(path, n_vocab, vram, host, chunk):
    P = [prompt(n, n_vocab, seed=s) for n, s in ((40, 3), (17, 5), (29, 7))]
    # pieces on chunk boundaries (how the engine cuts them); sequence 2's second piece starts at position 16
    pieces = [[P[0]], [P[1]], [P[2][:16], P[2][16:]]]
    want = _pieces_alone(path, pieces, vram, host, chunk)
    got, apps = _pieces_batched(path, pieces, vram, host, chunk)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w)
        for j, (x, y) in enumerate(zip(g, w)):
            assert torch.equal(x, y), (i, j, (x - y).abs().max().item())
    return apps


@pytest.mark.parametrize("vram,host,chunk", [(5, 15, 16), (0, 0, 16), (32, 0, 64), (5, 15, 8)])
def test_batched_prefill_equals_solo(model, vram, host, chunk):
    """Prompt pieces of three sequences in one pass: every piece's logits (all rows) and the decode token after it
    are bit-identical to the sequence prefilled alone (invariant 6 for prefill), the pieces cut into their own
    position-aligned chunks (several chunks a piece, a piece that starts mid-prompt, one-chunk pieces); and the
    shared pass applies each expert once for all of them: fewer applications than the three pieces alone."""
    apps = _check_batched_prefill(model, ENGINE_SPEC["n_vocab"], vram, host, chunk)
    rn, st = in_process_runner(model, vram, host, prefill_chunk=chunk)
    try:
        alone = sum(sum(rn.forward(p, rn.new_cache(96))[1].reads.values())
                    for p in (prompt(40, ENGINE_SPEC["n_vocab"], 3), prompt(17, ENGINE_SPEC["n_vocab"], 5),
                              prompt(29, ENGINE_SPEC["n_vocab"], 7)[16:]))
    finally:
        close_runner(rn, st)
    assert apps < alone, (apps, alone)


def test_batched_prefill_deepseek4(tmp_path_factory):
    """The second architecture through the same pass (its window ring and compressed entries per sequence)."""
    from dataclasses import replace as _replace
    from betelgeuse.gguf.synth import spec_from_preset, write_model
    path = tmp_path_factory.mktemp("ds4b") / "ds4.gguf"
    write_model(path, _replace(spec_from_preset("ds4-tiny"), seed=2), progress=False)
    _check_batched_prefill(path, 512, 2, 3, 16)
