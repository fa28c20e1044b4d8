"""trials.csv: one row per trial in every state, with stable columns (docs/results.md).

It is rewritten after every trial so an interrupted sweep still has it; the same
table, with a few columns more, feeds the HTML report.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import optuna
import pandas as pd
from optuna.trial import TrialState

from autotune.config import GIB
from autotune.plan.layout import KEYS, Layout, parse_layout
from autotune.record import COMPLETE, FAILED, INTERRUPTED, PRUNED, merged, step_time_spread
from autotune.record import REMEASURED_ATTR as REMEASURED

LAYOUT_COLUMNS = list(KEYS)
CSV_COLUMNS = (["trial", "status", "reason"] + LAYOUT_COLUMNS +
               ["grad_accum", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s", "step_time_min_s",
                "step_time_max_s", "confirmed", "peak_mem_gb",
                "predicted_peak_mem_gb", "comm_fraction", "exposed_comm_fraction", "predicted_tokens_per_s",
                "duration_s", "error"])
# Columns the HTML report uses besides the CSV's (not in the CSV: its columns are a contract).
EXTRA_COLUMNS = ["layout", "layout_short", "value", "world_size", "predicted_step_time_s", "predicted_mfu",
                 "predicted_comm_fraction", "stderr_tail"]
STATE_STATUS = {TrialState.COMPLETE: COMPLETE, TrialState.PRUNED: PRUNED, TrialState.FAIL: FAILED,
                TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}


def trial_table(study: optuna.Study) -> pd.DataFrame:
    """Every trial with the CSV's columns and the report's extra ones; a re-measured trial
    (remeasure.py) with the median of its runs."""
    rows = []
    remeasured = study.user_attrs.get(REMEASURED, {})
    objective = study.user_attrs.get("question", {}).get("objective", "tokens_per_s")
    for t in study.get_trials(deepcopy=False):
        runs = remeasured.get(str(t.number), [])
        a, value = merged(t.user_attrs, t.value if t.state == TrialState.COMPLETE else None, runs, objective)
        row = {"trial": t.number, "status": a.get("status") or STATE_STATUS[t.state],
               "reason": a.get("reason") or (INTERRUPTED if t.state == TrialState.FAIL else None)}
        # Every key, those a layout string leaves at their defaults too (layout.LATER_KEYS).
        row.update(dataclasses.asdict(Layout(**parse_layout(a["layout"]))) if "layout" in a else {})
        for key in ("grad_accum", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s", "comm_fraction",
                    "exposed_comm_fraction", "predicted_tokens_per_s", "duration_s", "error", "world_size",
                    "predicted_step_time_s", "predicted_mfu", "predicted_comm_fraction", "stderr_tail"):
            row[key] = a.get(key)
        row["peak_mem_gb"] = a["peak_mem_bytes"] / GIB if a.get("peak_mem_bytes") is not None else None
        predicted = a.get("predicted_peak_mem_bytes")
        row["predicted_peak_mem_gb"] = predicted / GIB if predicted is not None else None
        row["layout"] = a.get("layout")
        row["layout_short"] = a.get("layout_short") or (
            Layout(**parse_layout(a["layout"])).short() if "layout" in a else None)
        row["step_time_min_s"], row["step_time_max_s"] = step_time_spread(a)
        row["confirmed"] = int(bool(runs))
        row["value"] = value
        rows.append(row)
    return pd.DataFrame(rows, columns=CSV_COLUMNS + EXTRA_COLUMNS)


def ranked(table: pd.DataFrame) -> pd.DataFrame:
    """The complete trials, best first (ties: the earlier trial)."""
    return table[table["status"] == COMPLETE].sort_values(["value", "trial"], ascending=[False, True])


def write_csv(study: optuna.Study, path: Path, table: pd.DataFrame | None = None) -> pd.DataFrame:
    """Write atomically (temp file + rename): a reader never sees half a CSV. `table`: the
    study's trial_table when the caller has it already."""
    frame = (trial_table(study) if table is None else table)[CSV_COLUMNS]
    tmp = path.with_suffix(".csv.tmp")
    frame.to_csv(tmp, index=False)
    os.replace(tmp, path)
    return frame
