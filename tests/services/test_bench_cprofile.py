"""The bench's BENCH_DECODE_CPROFILE hook (services/bench/profile.py DecodeCProfile): off unless the environment names
a file; on, the file holds the profiled functions by own and cumulative time."""

from services.bench.profile import DecodeCProfile


def _busy_decode_step():
    return sum(i * i for i in range(20000))


def test_off_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(DecodeCProfile.ENV, raising=False)
    prof = DecodeCProfile().start()
    _busy_decode_step()
    prof.finish(1)
    assert prof.path is None and not list(tmp_path.iterdir())


def test_on_writes_both_tables(monkeypatch, tmp_path):
    out = tmp_path / "decode.prof.txt"
    monkeypatch.setenv(DecodeCProfile.ENV, str(out))
    prof = DecodeCProfile().start()
    _busy_decode_step()
    prof.finish(3)
    text = out.read_text()
    assert text.count("# 3 decode tokens profiled") == 2
    assert "sorted by tottime" in text and "sorted by cumulative" in text
    assert "_busy_decode_step" in text
