"""The leading layouts measured again at the end of a sweep.

A trial measures a few steps once; on a shared machine (or a GPU cluster with a noisy
neighbour) the best and the second best can trade places from one run to the next. At the
end of a sweep the leading layouts (default 3, `--confirm K`) are run again in fresh
processes; their runs are kept in the study's user attribute `remeasured` and read back by
record.merged.
"""

from __future__ import annotations


def leaders(trials: list, count: int, remeasured: dict) -> list:
    """The `count` best complete trials (by value, then number) not yet re-measured."""
    complete = sorted((t for t in trials if t.state.name == "COMPLETE" and t.value is not None),
                      key=lambda t: (-t.value, t.number))
    return [t for t in complete[:count] if str(t.number) not in remeasured]
