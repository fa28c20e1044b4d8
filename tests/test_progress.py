"""The sweep's progress lines: trials done and left, and the time left estimated from
the launched trials' wall times (autotune/study/progress.py)."""

import io

from rich.console import Console

from autotune.study import progress as progress_module
from autotune.study.controller import Tally
from autotune.study.progress import Progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_each_trial_line_says_what_is_done_and_left_and_when_it_ends(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    out = io.StringIO()
    with Progress("sweep", "tokens_per_s", total_layouts=20, trials=None, time_budget_s=None,
                  console=Console(file=out, force_terminal=False, width=200)) as p:
        tally = Tally()
        p.trial_started(0, "dp=4")
        clock.now += 30.0  # a launched trial of 30 s
        tally.complete, tally.launched = 1, 1
        p.trial_finished(tally)
        tally.pruned += 1  # a layout pruned before launch: no time
        p.trial_finished(tally)
    lines = out.getvalue().splitlines()
    assert lines[-2].endswith("[1 done, 19 left, ETA at most 9m30s]")  # 19 x 1/1 launched x 30 s
    assert lines[-1].endswith("[2 done, 18 left, ETA at most 4m30s]")  # 18 x 1/2 launched x 30 s


def test_the_launch_budget_and_the_time_budget_cap_what_is_left(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    p = Progress("sweep", "tokens_per_s", total_layouts=20, trials=4, time_budget_s=100.0,
                 console=Console(file=io.StringIO(), force_terminal=False))
    tally = Tally(complete=1, launched=1)
    p.trial_started(0, "dp=4")
    clock.now += 30.0
    p.trial_finished(tally)
    assert p.remaining() == "1 done, 3 left, ETA at most 1m10s"  # 3 x 30 s = 90 s, but 70 s of budget left
