"""The bench's start-up capture (Harness._graphs_warm): ModelRunner.warm_graphs over the decode's state size, in the
form the bench decodes in (solo: forward()), under the timed decode's device marks (SoloDecode keys its graphs on
them: a warm-up without them would capture graphs the timed decode never replays)."""

from types import SimpleNamespace

import pytest

from services.bench.harness import Harness


class _Runner:
    def __init__(self):
        self.gpu_marks, self.calls = False, []

    def warm_graphs(self, n, lanes):
        self.calls.append((n, lanes, self.gpu_marks))
        return {"captured": 7}


@pytest.mark.parametrize("marks", [False, True])
def test_warm_under_the_timed_decodes_marks_then_restored(marks):
    h = object.__new__(Harness)
    h.o = SimpleNamespace(gpu_marks=marks)
    rn = _Runner()
    assert h._graphs_warm(rn, 136) == {"captured": 7}
    assert rn.calls == [(136, False, marks)] and rn.gpu_marks is False
