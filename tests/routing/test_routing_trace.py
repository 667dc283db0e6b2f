"""Routing traces: the file format, record -> replay -> record through the reference model, the readers of the public
formats (research/data-candidates.md §1, §3) and `betelgeuse routing`."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from betelgeuse.routing import public as P
from betelgeuse.routing.measure import ArraySink
from betelgeuse.routing.trace import MAGIC, Recorder, Replayer, TraceWriter, read_trace, write_trace


def test_trace_file_roundtrip_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(16, 4, replace=False) for _ in range(3)] for _ in range(5)])
    w = rng.random((5, 3, 4)).astype(np.float32)
    p = tmp_path / "t.bgrt"
    write_trace(p, ids, 16, w, model="m.gguf")
    t = read_trace(p)
    assert (t.ids == ids).all() and (t.weights == w).all()
    assert t.header == {"n_layer": 3, "n_expert": 16, "k": 4, "weights": True, "model": "m.gguf"}
    w2 = TraceWriter(tmp_path / "a.bgrt", 3, 16, 4, weights=False)       # appendable, ids only
    w2.append(ids[:2])
    w2.append(ids[2:])
    w2.close()
    assert (read_trace(tmp_path / "a.bgrt").ids == ids).all() and read_trace(tmp_path / "a.bgrt").weights is None
    (tmp_path / "bad").write_bytes(b"hello\n")
    with pytest.raises(ValueError, match="not a routing trace"):
        read_trace(tmp_path / "bad")
    (tmp_path / "cut").write_bytes(p.read_bytes()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        read_trace(tmp_path / "cut")
    (tmp_path / "hdr").write_bytes(MAGIC + b"{}\n")
    with pytest.raises(ValueError, match="bad trace header"):
        read_trace(tmp_path / "hdr")


def _recorded(model, prompt, replay=None):
    """(ids, weights, logits) of a prefill of `prompt`, routing recorded (and driven by `replay` if given)."""
    route = model.__class__.route.__get__(model)
    sink = ArraySink(model.cfg.n_layer)
    rec = Recorder(sink)
    model.route = rec.wrap(replay.wrap(route) if replay is not None else route)
    try:
        logits = model.forward(torch.tensor(prompt), model.new_cache(len(prompt) + 1))
    finally:
        del model.route
    rec.close()
    return (*sink.arrays(), logits)


@torch.inference_mode()
def test_record_replay_record_gives_the_same_trace(tmp_path, tiny_model):
    from betelgeuse.model import reference_model
    m = reference_model(tiny_model)
    c = m.cfg
    a_ids, a_w, a_logits = _recorded(m, list(range(3, 90)))
    p = tmp_path / "a.bgrt"
    write_trace(p, a_ids, c.n_expert, a_w)
    other = list(range(200, 287))                                  # other tokens: the router would choose otherwise
    free_ids, _, _ = _recorded(m, other)
    assert (free_ids != a_ids).any()
    rp = Replayer(read_trace(p), c.n_layer, c.n_expert, c.n_expert_used)
    b_ids, b_w, _ = _recorded(m, other, rp)
    write_trace(tmp_path / "b.bgrt", b_ids, c.n_expert, b_w)
    assert (tmp_path / "b.bgrt").read_bytes() == p.read_bytes()
    # the same tokens replayed: the recorded run's outputs, bit for bit
    _, _, logits = _recorded(m, list(range(3, 90)), Replayer(read_trace(p), c.n_layer, c.n_expert, c.n_expert_used))
    assert torch.equal(logits, a_logits)
    with pytest.raises(ValueError, match="the model has"):
        Replayer(read_trace(p), c.n_layer + 1, c.n_expert, c.n_expert_used)


def test_public_trace_readers(tmp_path):
    # FLAME-MoE CSV: one file per layer, router probabilities of the k chosen experts, zeros elsewhere
    for layer, rows in ((2, [[0.1, 0, 0.3, 0], [0, 0.2, 0, 0.05]]), (3, [[0, 0, 0.4, 0.1], [0.2, 0.3, 0, 0]])):
        d = tmp_path / "flame" / f"Layer_{layer}"
        d.mkdir(parents=True)
        lines = ["layer_id,token_id," + ",".join(f"expert_{e}" for e in range(4))]
        lines += [f"0,{t}," + ",".join(f"{x:.6f}" for x in r) for t, r in enumerate(rows)]
        (d / f"m_layer{layer}_encoder.csv").write_text("\n".join(lines) + "\n")
    ids, w, starts, layers = P.read_flame_csvs(tmp_path / "flame", k=2, seq_len=1)
    assert layers == [2, 3] and starts == [0, 1]
    assert ids.tolist() == [[[2, 0], [2, 3]], [[1, 3], [1, 0]]]
    assert w[0, 0].tolist() == pytest.approx([0.3, 0.1])
    with pytest.raises(ValueError, match="expected 3"):
        P.read_flame_csvs(tmp_path / "flame", k=3)
    # route JSONL (vLLM-MoE-Logger style), a header line, two requests
    recs = [{"type": "meta", "model": "x"}]
    for req, toks in (("r1", 2), ("r2", 1)):
        for t in range(toks):
            for layer in (0, 1):
                recs.append({"type": "route", "req_id": req, "token_idx": t, "layer": layer,
                             "topk_ids": [t + layer, 5], "topk_weights": [0.6, 0.4]})
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    ids, w, starts = P.read_route_jsonl(tmp_path / "r.jsonl")
    assert ids.tolist() == [[[0, 5], [1, 5]], [[1, 5], [2, 5]], [[0, 5], [1, 5]]] and starts == [0, 2]
    assert w.shape == (3, 2, 2)
    # Strata --dump-routing: (i32 layer, i32 k, k ids, k weights) records, a tag record skipped
    blob = b""
    for layer, e in ((0, 1), (1, 2), (-1, 0), (0, 3), (1, 4)):
        blob += struct.pack("<ii", layer, 2) + struct.pack("<2i", e, 7) + struct.pack("<2f", 0.7, 0.3)
    (tmp_path / "s.bin").write_bytes(blob)
    ids, w = P.read_strata_dump(tmp_path / "s.bin")
    assert ids.tolist() == [[[1, 7], [2, 7]], [[3, 7], [4, 7]]]
    # profiles
    (tmp_path / "k.json").write_text(json.dumps({"0,1": 3, "1,0": 2, "_metadata": {"x": 1}}))
    assert P.read_krasis_heatmap(tmp_path / "k.json", 3).tolist() == [[0, 3, 0], [2, 0, 0]]
    (tmp_path / "f.json").write_text(json.dumps({"total_input_tokens": 9, "expert_popularity": [[1, 2], [3, 4]]}))
    assert P.read_fiddler_popularity(tmp_path / "f.json").tolist() == [[1, 2], [3, 4]]


def test_routing_cli(tmp_path, capsys):
    from services.cli import main as cli

    def main(argv):
        return cli(["routing"] + argv)
    recs = [{"layer": layer, "token_idx": t, "topk_ids": [t % 3, 3]} for t in range(6) for layer in (0, 1)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    assert main(["convert", str(tmp_path / "r.jsonl"), str(tmp_path / "r.bgrt"), "--format", "jsonl",
                 "--experts", "4"]) == 0
    assert read_trace(tmp_path / "r.bgrt").ids.shape == (6, 2, 2)
    assert main(["stats", str(tmp_path / "r.bgrt")]) == 0
    assert "repeat_next 0.500" in capsys.readouterr().out      # expert 3 every token, the other never twice in a row
    assert main(["stats", str(tmp_path / "r.jsonl"), "--format", "jsonl"]) == 2
    assert "--experts is needed" in capsys.readouterr().err
    (tmp_path / "k.json").write_text(json.dumps({"0,1": 3}))
    assert main(["convert", str(tmp_path / "k.json"), str(tmp_path / "x"), "--format", "krasis", "--experts", "4"]) == 2
    assert "nothing to convert" in capsys.readouterr().err
    assert main(["stats", str(tmp_path / "r.jsonl"), "--format", "krasis", "--experts", "4"]) == 2
    assert "not a krasis routing file" in capsys.readouterr().err


def test_engine_records_replays_and_records_again(tmp_path, tiny_model):
    """The out-of-core engine (a real in-process store, layer-major prefill then decode) records what its router
    chose -- the reference model's routing of the same tokens --, and a replayed trace drives exactly those choices
    on other tokens: recording the replay gives the same file."""
    from betelgeuse.routing.measure import reference_trace
    from betelgeuse.routing.trace import Recorder, Replayer, TraceWriter
    from tests.engine_helpers import close_runner, in_process_runner

    def run(rn, ids, decode):
        kv = rn.new_cache(len(ids) + len(decode) + 1)
        logits, _ = rn.forward(ids, kv)
        for tok in decode:
            rn.forward([tok], kv, consolidate=False)
        return logits

    a, b = tmp_path / "a.bgrt", tmp_path / "b.bgrt"
    rn, st = in_process_runner(tiny_model, 2, 4, record_routing=str(a))
    c = rn.mcfg
    ids, decode = list(range(5, 75)), [9, 9, 40]
    try:
        run(rn, ids, decode)
    finally:
        close_runner(rn, st)
    ref_ids, _, _ = reference_trace(tiny_model, ids + decode)
    assert (read_trace(a).ids == ref_ids).all()
    rn, st = in_process_runner(tiny_model, 2, 4)
    try:
        rn.hook_routing(Recorder(TraceWriter(b, c.n_layer, c.n_expert, c.n_expert_used, model=str(tiny_model),
                                             arch=c.arch)),
                        Replayer(read_trace(a), c.n_layer, c.n_expert, c.n_expert_used))
        run(rn, list(range(100, 170)), [1, 2, 3])
        rn.hook_routing()                              # back to the model's own routing; the recorder is closed
        assert "route" not in rn.model.__dict__
    finally:
        close_runner(rn, st)
    assert b.read_bytes() == a.read_bytes()


def test_cli_records_routing(tmp_path, tiny_model):
    """`betelgeuse logits --record-routing` with the reference engine and the out-of-core engine: the same trace."""
    from services.cli import main
    ids = ",".join(str(i) for i in range(3, 40))
    for engine in ("reference", "in-process"):
        assert main(["logits", str(tiny_model), "--token-ids", ids, "-o", str(tmp_path / f"{engine}.npy"),
                     "--engine", engine, "--record-routing", str(tmp_path / f"{engine}.bgrt")]) == 0
    r, e = read_trace(tmp_path / "reference.bgrt"), read_trace(tmp_path / "in-process.bgrt")
    assert r.ids.shape[0] == 37 and (r.ids == e.ids).all()
    assert main(["logits", str(tiny_model), "--token-ids", ids, "-o", str(tmp_path / "x.npy"), "--engine",
                 "reference", "--record-routing", str(tmp_path / "no" / "such" / "dir.bgrt")]) == 2


def test_bench_refuses_record_routing(tmp_path, monkeypatch, capsys):
    """The bench writes no trace of its own runners (each case would overwrite the last's): the key is not one of
    its flags, and set in the environment it is one error line naming its source."""
    from services.cli import main
    monkeypatch.setenv("BETELGEUSE_ENGINE_RECORD_ROUTING", str(tmp_path / "t.bgrt"))
    assert main(["bench", "--quick", "--device", "cpu", "--work-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "engine.record_routing (env BETELGEUSE_ENGINE_RECORD_ROUTING)" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("*.gguf"))
    monkeypatch.delenv("BETELGEUSE_ENGINE_RECORD_ROUTING")
    assert main(["bench", "--quick", "--record-routing", str(tmp_path / "t.bgrt")]) == 2
    assert "unrecognized arguments: --record-routing" in capsys.readouterr().err
