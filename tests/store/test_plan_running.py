"""max_running = auto (issue 24): the slot plan reserves KV for as many sequences (1..8) as leave the VRAM budget a
minimum of VRAM expert slots per layer (the top-k, or vram_slots as configured), and says so in its why; a number
is kept as given, and one whose KV cannot fit is refused with the numbers (a CLI line and exit 2, no traceback).

The KV a sequence costs is computed here from the model's shapes (K and V of every layer and KV head, bfloat16 on
CUDA), not read back from the plan, and the plan runs on the CPU for device="cuda" (it needs no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from betelgeuse.config import MiB, EngineConfig
from betelgeuse.errors import BudgetError
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.plan import GRAPHS_BYTES_PER_SEQ, MAX_RUNNING_AUTO, plan_slots

ROOT = Path(__file__).parents[2]
CTX = 4096


@pytest.fixture(scope="module")
def tiny(tiny_model):
    f = GGUFModelFile.open(str(tiny_model))
    yield f
    f.close()


def _gpu(tiny, **kw) -> EngineConfig:
    return EngineConfig(model_path=tiny.path, device="cuda", prefix_host_bytes=0, max_context=CTX, **kw)


def _per_seq(tiny) -> int:
    """VRAM one more running sequence costs on CUDA: its full-context K and V (bfloat16) and its decode graphs."""
    c = tiny.config
    return 2 * c.n_layer * c.n_head_kv * c.head_dim * CTX * 2 + GRAPHS_BYTES_PER_SEQ


def test_auto_reserves_eight_where_they_fit_and_fewer_on_a_tight_budget(tiny):
    c = tiny.config
    p = plan_slots(tiny, _gpu(tiny), None)                         # 12 GiB for a tiny model: the cap
    d = p.describe()
    assert (p.max_running, d["max_running"], d["max_running_requested"]) == (MAX_RUNNING_AUTO, 8, "auto")
    assert d["kv_bytes"] == 8 * (_per_seq(tiny) - GRAPHS_BYTES_PER_SEQ)
    assert "max_running=auto -> 8 (of at most 8)" in d["why"] and "(top-k)" in d["why"], d["why"]
    one = plan_slots(tiny, _gpu(tiny, max_running=1), None).vram_fixed       # everything but the sequences' KV
    per_layer = c.n_layer * p.slot.slot_bytes
    floor = c.n_expert_used * per_layer                                       # the top-k's VRAM slots
    for n in (5, 3, 2):
        budget = one + (n - 1) * _per_seq(tiny) + floor
        q = plan_slots(tiny, _gpu(tiny, vram_budget=budget), None)
        assert q.max_running == n and q.n_vram == c.n_expert_used, (n, q.describe()["why"])
        assert q.vram_parts["kv"] == n * (_per_seq(tiny) - GRAPHS_BYTES_PER_SEQ)
        assert f"max_running=auto -> {n} (of at most 8)" in q.describe()["why"]
        assert f"{n + 1} would need {_per_seq(tiny) / MiB:,.0f} MiB more" in q.describe()["why"], q.describe()["why"]
        r = plan_slots(tiny, _gpu(tiny, vram_budget=budget - 1), None)         # a byte short: one sequence fewer
        assert r.max_running == n - 1 and r.n_vram >= c.n_expert_used, r.describe()["why"]
    # not even one sequence leaves the top-k's slots: one runs, the VRAM tier gets what is left
    q = plan_slots(tiny, _gpu(tiny, vram_budget=one + floor - 1), None)
    assert (q.max_running, q.n_vram) == (1, c.n_expert_used - 1)
    assert "max_running=auto -> 1: even one sequence's KV" in q.describe()["why"]
    # with vram_slots as configured, the floor is that count
    budget = one + 2 * _per_seq(tiny) + 6 * per_layer
    q = plan_slots(tiny, _gpu(tiny, vram_budget=budget, vram_slots=6), None)
    assert (q.max_running, q.n_vram) == (3, 6) and "vram_slots as configured" in q.describe()["why"]


def test_an_explicit_count_is_kept_and_refused_with_the_numbers_when_it_cannot_fit(tiny):
    c = tiny.config
    one = plan_slots(tiny, _gpu(tiny, max_running=1), None).vram_fixed
    budget = one + 3 * _per_seq(tiny) + 2 * c.n_layer * plan_slots(tiny, _gpu(tiny), None).slot.slot_bytes
    p = plan_slots(tiny, _gpu(tiny, vram_budget=budget, max_running=2), None)    # fewer than fit: kept
    assert (p.max_running, p.describe()["max_running_requested"]) == (2, "2")
    assert "max_running=2 as configured" in p.describe()["why"]
    with pytest.raises(BudgetError, match=r"KV cache for 8 x 4096 tokens .*max_running=8 is over what fits: at most "
                                          r"4 sequences' KV fit \(set max_running = 4, or \"auto\": 3 beside the "
                                          r"top-k's VRAM slots\)"):
        plan_slots(tiny, _gpu(tiny, vram_budget=one + 3 * _per_seq(tiny), max_running=8), None)
    # the fixed needs of 8 fit, 2 VRAM slots per layer beside them do not (one does): 7 sequences would
    per_layer = c.n_layer * plan_slots(tiny, _gpu(tiny), None).slot.slot_bytes
    with pytest.raises(BudgetError, match=r"2 VRAM slots per layer need .*KV cache for 8 x 4096 tokens .*beside them "
                                          r"at most 7 sequences' KV fit \(max_running = 7\)"):
        plan_slots(tiny, _gpu(tiny, vram_budget=one + 7 * _per_seq(tiny) + per_layer, max_running=8, vram_slots=2),
                   None)


def test_the_cli_refuses_a_max_running_that_cannot_fit_in_one_line(tiny_model, tmp_path):
    """`betelgeuse generate` starts the store, which plans: exit 2 and the plan's numbers, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "services.cli", "generate", str(tiny_model), "--token-ids", "1,2,3",
                        "--max-tokens", "2", "--device", "cpu", "--max-running", "8", "--vram-budget", "30MiB"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "KV cache for 8 x 4096 tokens" in p.stderr and "max_running=8 is over what fits: at most" in p.stderr, \
        p.stderr
