"""deploy/device/chain_latency.py's split of a load's chain (issue 21) through a real store process: every load is
matched to the store's message log and the disk's idle gaps, on one clock across the two processes, so each stamp
follows the one before it (send <= took <= first read <= read landed <= handed over <= the worker's reader has it <=
the main thread has it: no link below zero, to within a clock read), the links sum to the whole, and every load read
its expert from disk (the keys cycle through more experts than the store has staging slots)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _tool():
    spec = importlib.util.spec_from_file_location("chain_latency", Path(__file__).parents[2] /
                                                  "deploy/device/chain_latency.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_loads_links_are_ordered_and_sum_to_its_whole(tmp_path):
    tool = _tool()
    rows, info = tool.measure(40, tmp_path, "idle", "seqpacket")
    assert info["loads"] >= 35 and info["disk_reads"] == info["loads"], info
    assert info["read_mode"] in ("direct", "buffered")
    parts = [k for k in tool.LINKS if k not in ("host", "total")]
    for i, total in enumerate(rows["total"]):
        links = [rows[k][i] for k in parts]
        assert min(links) > -20e-6, dict(zip(parts, links))          # the stamps in order (20 µs: clock reads)
        assert abs(sum(links) - total) < 1e-6, (links, total)
        assert abs(rows["host"][i] - (total - rows["disk"][i])) < 1e-6
