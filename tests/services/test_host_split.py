"""services/bench/harness.py HostSplit: a decode's host time by part, and the steady tokens' split apart from the
first two (a solo decode's eager step and graph capture: nearly all rest; issue 21)."""

from __future__ import annotations

import pytest

from betelgeuse.worker.stats import PassStats
from services.bench.harness import HostSplit


def _pass(store_ms: float, moe_ms: float, rest_ms: float, apps: int) -> PassStats:
    st = PassStats("decode", "layer_major", 1)
    st.store_rpc = {"load": [2, store_ms / 1e3]}
    st.moe_host_s = moe_ms / 1e3
    st.host_s = (store_ms + moe_ms + rest_ms) / 1e3
    st.reads = {"vram": apps, "host": 0, "disk": 0}
    return st


def test_the_steady_split_leaves_the_first_two_tokens_out():
    hs = HostSplit()
    for p in [(0.5, 2.0, 30.0, 48), (0.5, 2.0, 45.0, 48)] + [(0.3, 4.8, 1.2, 48), (0.3, 4.8, 2.4, 48)]:
        hs.add(_pass(*p))
    rec = hs.record(4, 4 * 48)
    steady = rec["steady_split_us_per_application"]
    assert steady["store"] == pytest.approx(0.6e3 / 96)
    assert steady["moe"] == pytest.approx(9.6e3 / 96)
    assert steady["other"] == pytest.approx(3.6e3 / 96)
    assert rec["other_host_us_per_application"] == pytest.approx(78.6e3 / 192)     # the whole run's, as before
    assert HostSplit().record(0, 0)["steady_split_us_per_application"] is None
