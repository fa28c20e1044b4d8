"""When a sweep that was given no budget stops: once more trials are not expected to pay.

A space of a real model holds thousands of layouts; measuring them all takes days. A
sweep with neither `--trials` nor `--time-budget` (and without `--exhaustive`) stops when
both hold:

- PATIENCE launched trials in a row have not improved the best measured value by
  IMPROVEMENT or more (a trial pruned or failed after launch counts: it was paid for);
- the estimator, calibrated on the trials measured so far, predicts no untaken layout
  that fits to come within MARGIN of the best: best x (1 - MARGIN) or more.

The second condition keeps a sweep going while the estimator still sees a contender;
the first keeps it from stopping on the estimator's word alone. The constants are the
setting benchmarks/stopping_rule.py found best on the search-efficiency scenarios
(benchmarks/RESULTS.md, "The stopping rule"). `--exhaustive` or a budget overrides the rule.

A small space is measured in proportion to its size: the patience is at most a quarter
of its layouts (SMALL_SPACE_SHARE), and at least MIN_PATIENCE, so a first sweep of a
few dozen layouts does not measure nearly all of them before it may stop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

PATIENCE = 10
IMPROVEMENT = 0.01
MARGIN = 0.25
SMALL_SPACE_SHARE = 0.25
MIN_PATIENCE = 3


def patience_for(layouts: int) -> int:
    """PATIENCE, or a quarter of a small space's layouts (at least MIN_PATIENCE)."""
    return min(PATIENCE, max(MIN_PATIENCE, math.ceil(layouts * SMALL_SPACE_SHARE)))


def trials_since_improvement(values: Iterable[float | None], improvement: float | None = None) -> tuple[float, int]:
    """(best value, launched trials since the best last rose by `improvement` or more).

    `values`: the objective of each launched trial in launch order, None for one that
    did not complete. Before the first complete trial the best is -inf."""
    improvement = IMPROVEMENT if improvement is None else improvement
    best, since = -math.inf, 0
    for value in values:
        if value is not None and (best == -math.inf or value >= best * (1 + improvement)):
            best, since = value, 0
        else:
            since += 1
            if value is not None:
                best = max(best, value)
    return best, since


def stop_reason(values: list[float | None], untaken_predictions: Iterable[float], patience: int | None = None,
                improvement: float | None = None, margin: float | None = None) -> str | None:
    """Why the sweep should stop now, or None to go on.

    `untaken_predictions`: the calibrated estimator's objective for every layout not yet
    taken that it predicts to fit (an unknown figure is -inf and never a contender).
    Omitted constants are this module's, read at the call (the benchmark varies them)."""
    patience = PATIENCE if patience is None else patience
    improvement = IMPROVEMENT if improvement is None else improvement
    margin = MARGIN if margin is None else margin
    best, since = trials_since_improvement(values, improvement)
    if best == -math.inf or since < patience:
        return None
    bar = best * (1 - margin)
    contenders = sum(1 for predicted in untaken_predictions if predicted >= bar)
    if contenders:
        return None
    return (f"{since} launched trials in a row without improving the best by {improvement:.0%}, and no untaken "
            f"layout predicted within {margin:.0%} of it (--exhaustive measures every layout)")
