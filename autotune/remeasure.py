"""The leading layouts measured again, and what a trial's figures are once they have been.

A trial measures a few steps once; on a shared machine (or a GPU cluster with a noisy
neighbour) the best and the second best can trade places from one run to the next. At the
end of a sweep the leading layouts (default 3, `--confirm K`) are run again in fresh
processes. Their runs are kept in the study's user attribute `remeasured`
({trial number: [figures of each complete re-run]}), beside the trial's own, and a
re-measured trial's figures are the median over all its runs (with one re-run: the mean
of the two). Pure Python: the table and the report read it without Optuna's objects.
"""

from __future__ import annotations

import statistics

from autotune.record import METRICS

ATTR = "remeasured"
# What a re-run keeps of its trial JSON: the metrics and the steps they come from.
KEPT = METRICS + ("step_times_s", "duration_s")


def kept(record: dict) -> dict:
    return {key: record[key] for key in KEPT if record.get(key) is not None}


def leaders(trials: list, count: int, remeasured: dict) -> list:
    """The `count` best complete trials (by value, then number) not yet re-measured."""
    complete = sorted((t for t in trials if t.state.name == "COMPLETE" and t.value is not None),
                      key=lambda t: (-t.value, t.number))
    return [t for t in complete[:count] if str(t.number) not in remeasured]


def merged(attrs: dict, value: float | None, runs: list[dict], objective: str) -> tuple[dict, float | None]:
    """A trial's figures over its own run and its re-runs: each metric's median, the
    objective's too; step_times_s all measured steps of every run."""
    if not runs:
        return attrs, value
    every = [attrs] + runs
    out = dict(attrs)
    for key in METRICS:
        values = [run[key] for run in every if run.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    out["step_times_s"] = [s for run in every for s in run.get("step_times_s") or ()]
    return out, out.get(objective, value)


def step_time_spread(attrs: dict) -> tuple[float | None, float | None]:
    """The fastest and the slowest measured step (over every run of a re-measured trial)."""
    steps = attrs.get("step_times_s") or []
    return (min(steps), max(steps)) if steps else (None, None)
