"""Bytes per step by gloo collective, from the events' recorded input sizes (fast tier)."""

import numpy as np

from autotune.runtime.event_table import EventTable
from autotune.runtime.profiling import comm_bytes


def test_bytes_per_step_count_only_gloo_events_inside_the_steps():
    table = EventTable(names=["gloo:all_gather", "gloo:send", "aten::mm"], code=np.array([0, 0, 1, 2, 0]),
                       kind_names=["cpu"], kind=np.zeros(5, dtype=np.int64), cuda=np.zeros(5, dtype=bool),
                       thread=np.zeros(5, dtype=np.int64), start=np.array([10, 120, 130, 140, 300]),
                       end=np.array([20, 125, 135, 145, 310]), nbytes=np.array([40, 80, 16, 0, 999]))
    # two steps [0, 100) and [100, 200): the event at 300 lies outside both
    assert comm_bytes(table, [(0, 100), (100, 200)]) == {"gloo:all_gather": 60, "gloo:send": 8}
    table.nbytes = None
    assert comm_bytes(table, [(0, 100)]) is None
