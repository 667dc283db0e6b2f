"""The expert kernels' launch table (betelgeuse/kernels/triton_tuning.json, triton_moe.load_tuning / config): the
committed file loads; reduction keys (BK, KC) only per type, schedules only per rows bucket; a bad file is refused
with a message naming the problem; a bucket's schedule never changes a reduction key."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from betelgeuse.kernels import triton_moe  # noqa: E402
from betelgeuse.kernels.triton_quants import QT_CODES  # noqa: E402

Q4_K = QT_CODES[12]


def _file(tmp_path, types) -> str:
    p = tmp_path / "tuning.json"
    p.write_text(json.dumps({"types": types}))
    return str(p)


def test_committed_table_loads_and_keeps_reduction_keys_per_type():
    tab = triton_moe.load_tuning(triton_moe.TUNING_FILE)
    for code, ent in tab.items():
        assert set(ent) <= {"reduce", *triton_moe.BUCKETS}
        assert set(ent["reduce"]) <= triton_moe.REDUCE_KEYS
        for b in triton_moe.BUCKETS:
            assert set(ent.get(b, {})) <= triton_moe.SCHEDULE_KEYS
            c = triton_moe.config(code, b)
            assert c["KC"] == 0 or c["KC"] % c["BK"] == 0, (code, c)


def test_buckets_share_reduction_keys(tmp_path, monkeypatch):
    path = _file(tmp_path, {"Q4_K": {"BK": 256, "KC": 512,
                                     "rows1": {"BN": 16, "BN_GATE_UP": 16, "SPLIT": 1, "num_warps": 2},
                                     "rows16": {"BN": 64, "SPLIT": 0}}})
    monkeypatch.setattr(triton_moe, "TUNING", triton_moe.load_tuning(path))
    c1, c16 = triton_moe.config(Q4_K, 1), triton_moe.config(Q4_K, 16)
    assert (c1["BN"], c1["SPLIT"], c1["num_warps"]) == (16, 1, 2) and (c16["BN"], c16["SPLIT"]) == (64, 0)
    assert c1["KC"] == c16["KC"] == 512 and c1["BK"] == c16["BK"] == 256
    assert triton_moe.chunk(Q4_K, 2048, 256) == 512 and triton_moe.chunk(Q4_K, 512, 256) == 512
    assert triton_moe.chunk(Q4_K, 256, 256) == 256                      # one chunk: all of K
    monkeypatch.setitem(triton_moe.TYPE_CONFIG, Q4_K, {"BN": 32})       # overrides every bucket
    assert triton_moe.config(Q4_K, 1)["BN"] == triton_moe.config(Q4_K, 16)["BN"] == 32
    assert triton_moe.config(QT_CODES[8], 1) == {**triton_moe.CONFIG, **triton_moe.TYPE_CONFIG.get(0, {})}
    assert triton_moe.bucket_of(8, 128) == 1 and triton_moe.bucket_of(128, 128) == 1
    assert triton_moe.bucket_of(129, 128) == 16


@pytest.mark.parametrize("types, words", [
    ({"Q4_K": {"rows1": {"KC": 512}}}, ["rows1", "KC", "per type"]),
    ({"Q4_K": {"BN": 32}}, ["unknown key 'BN'"]),
    ({"Q4_K": {"rows7": {"BN": 32}}}, ["unknown key 'rows7'"]),
    ({"Q4_Z": {"BK": 256}}, ["'Q4_Z'", "not a type"]),
    ({"Q4_0": {"BK": 256}}, ["'Q4_0'", "not a type"]),
    ({"Q4_K": {"BK": 256, "KC": 384}}, ["Q4_K", "KC 384", "multiple"]),
    ({"Q8_0": {"KC": 100}}, ["Q8_0", "KC 100"]),
    ({"IQ4_XS": {"MV": 1}}, ["IQ4_XS", "MV", "decode schedule", "Q4_K"]),     # a type triton_mmvq lacks
    ({"Q4_K": {"MV": 2}}, ["Q4_K", "MV must be 0 or 1"]),
    ({"Q4_K": {"rows1": {"MV": 1}}}, ["rows1", "'MV'", "per type"]),           # a reduction key, not a schedule
    ({"Q4_K": {"MV": 1, "rows16": {"BM_MV": 3}}}, ["rows16", "BM_MV"]),
])
def test_bad_tables_are_refused_by_name(tmp_path, types, words):
    with pytest.raises(ValueError) as e:
        triton_moe.load_tuning(_file(tmp_path, types))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_decode_schedule_is_a_reduction_key(tmp_path, monkeypatch):
    """MV (triton_mmvq) is set per type, for both buckets; BM_MV (rows a program) per bucket."""
    path = _file(tmp_path, {"Q4_K": {"MV": 1, "rows1": {"BM_MV": 1, "BN": 8}, "rows16": {"BM_MV": 16, "BN": 2}}})
    monkeypatch.setattr(triton_moe, "TUNING", triton_moe.load_tuning(path))
    c1, c16 = triton_moe.config(Q4_K, 1), triton_moe.config(Q4_K, 16)
    assert c1["MV"] == c16["MV"] == 1 and (c1["BM_MV"], c1["BN"], c16["BM_MV"], c16["BN"]) == (1, 8, 16, 2)
    assert triton_moe.config(QT_CODES[8])["MV"] == 0                       # off by default
    assert triton_moe.mv_ok(Q4_K, 2048, 1152, True) and not triton_moe.mv_ok(Q4_K, 2048, 1152, False)
    assert triton_moe.mv_ok(QT_CODES[8], 2048, 2176, True)                 # Q8_0: K whole 64-element steps
    assert not triton_moe.mv_ok(QT_CODES[8], 96, 102, True)               # half a step; rows not 4-byte multiples
    assert not triton_moe.mv_ok(QT_CODES[23], 2048, 1088, True)           # IQ4_XS: not in triton_mmvq
    # Q6_K: 210-byte super-blocks, rows at 2-byte multiples (F 768: 630 B) read through aligned word pairs
    assert triton_moe.mv_ok(QT_CODES[14], 768, 630, True) and not triton_moe.mv_ok(QT_CODES[14], 768, 630, False)


def test_environment_chooses_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv(triton_moe.TUNING_ENV, "off")
    assert triton_moe.load_tuning() == {}
    monkeypatch.setenv(triton_moe.TUNING_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no tuning file"):
        triton_moe.load_tuning()
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setenv(triton_moe.TUNING_ENV, str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not JSON"):
        triton_moe.load_tuning()
    monkeypatch.setenv(triton_moe.TUNING_ENV, _file(tmp_path, {"Q2_K": {"KC": 256, "rows1": {"SPLIT": 1}}}))
    assert triton_moe.load_tuning() == {QT_CODES[10]: {"reduce": {"KC": 256}, 1: {"SPLIT": 1}}}


def _roofline():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "deploy" / "device" / "kernel_roofline.py"
    spec = importlib.util.spec_from_file_location("kernel_roofline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)                         # torch and gguf, no GPU
    return mod


def test_sweep_pairs_bucket_configs_only_with_the_same_bits():
    """kernel_roofline.choose: per type one (BK, KC); per bucket the fastest schedule whose outputs equal the other
    bucket's pick bit for bit; configs that fail their checks are never taken."""
    import torch
    rl = _roofline()
    assert [rl.CONFIGS[i]["KC"] for i in (0, 1, 4)] == [0, 512, 512] and rl.CONFIGS[1]["SPLIT"] == 1
    assert rl.CONFIGS[4]["SPLIT"] == 0
    us = {0: (10.0, 20.0), 1: (4.0, 30.0), 4: (9.0, 12.0)}            # (1 row, 16 rows) µs
    y = torch.arange(6.0)

    def per(out1, ok=True):
        m = {"configs": {ci: {"rows": {1: {"us": a}, 16: {"us": b}}} for ci, (a, b) in us.items()}}
        outs = {0: y + 1, 1: out1, 4: y}
        ck = {ci: ({"ok": ok or ci != 1}, {"rows1": outs[ci], "rows16": outs[ci]}) for ci in us}
        return {"bench": {"m": m, "ck": ck}}
    assert rl.choose(per(y.clone()), [0, 1, 4]) == (1, 4)               # split for 1 row, walked for 16
    assert rl.choose(per(y + 1e-3), [0, 1, 4]) == (4, 4)                # other bits: not paired
    assert rl.choose(per(y.clone(), ok=False), [0, 1, 4]) == (4, 4)     # a failed check is never taken


def test_the_vram_plan_counts_the_split_k_workspace():
    """The split-K partials (<= WS_LIMIT per stream, eager + graph-capture streams) are inside the VRAM plan."""
    from betelgeuse.kernels import triton_moe
    from betelgeuse.store import plan
    assert plan.SPLITK_WORKSPACE_BYTES >= 2 * triton_moe.WS_LIMIT


def test_a_stream_s_split_k_workspace_is_one_allocation_that_never_grows():
    """The partials of a stream are allocated once at WS_LIMIT: a workspace grown launch by launch kept every smaller
    one alive (the attach warm-ups' +200 MiB of torch's reserve on the device, gpu-run46-serve), beyond the plan's
    two WS_LIMITs. Growing tile counters keep their old tensors (a captured graph may point at them)."""
    import torch
    from betelgeuse.kernels import triton_moe as tm
    dev = torch.device("cpu")
    saved = dict(tm._WS), list(tm._WS_OLD)
    tm._WS.clear()
    tm._WS_OLD.clear()          # earlier tests in this process may have grown counters of their own
    try:
        ws, cnt = tm._workspace(dev, 100, 4)
        assert ws.numel() * 4 == tm.WS_LIMIT and cnt.numel() == 4 and not cnt.any()
        for n in (1_000, 1_000_000, tm.WS_LIMIT // 4):        # every split launch's partials, up to the limit
            assert tm._workspace(dev, n, 4)[0] is ws
        ws2, cnt2 = tm._workspace(dev, 10, 64)
        assert ws2 is ws and cnt2.numel() == 64 and any(t is cnt for t in tm._WS_OLD)
    finally:
        tm._WS.clear()
        tm._WS.update(saved[0])
        tm._WS_OLD[:] = saved[1]
