"""What the engineer reads in the morning: trials.csv (and, with the report issue, HTML).

trials.csv has one row per trial in every state, with stable columns (README,
"Results"); it is rewritten after every trial so an interrupted sweep still has it.
"""

from __future__ import annotations

import os
from pathlib import Path

import optuna
import pandas as pd
from optuna.trial import TrialState

from autotune.layout import INT_KEYS, STR_KEYS, parse_layout

LAYOUT_COLUMNS = ["tp", "pp", "cp", "ep", "dp", "dp_shard", "zero", "mbs", "schedule", "vpp", "recompute", "sp"]
CSV_COLUMNS = (["trial", "status", "reason"] + LAYOUT_COLUMNS +
               ["grad_accum", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s", "peak_mem_gb",
                "predicted_peak_mem_gb", "comm_fraction", "exposed_comm_fraction", "predicted_tokens_per_s",
                "duration_s", "error"])
GB = 1024 ** 3
STATE_STATUS = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
                TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}
assert set(LAYOUT_COLUMNS) == set(INT_KEYS + STR_KEYS)


def trial_rows(study: optuna.Study) -> pd.DataFrame:
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        row = {"trial": t.number, "status": a.get("status") or STATE_STATUS[t.state],
               "reason": a.get("reason") or ("interrupted" if t.state == TrialState.FAIL else None)}
        row.update(parse_layout(a["layout"]) if "layout" in a else {})
        for key in ("grad_accum", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s", "comm_fraction",
                    "exposed_comm_fraction", "predicted_tokens_per_s", "duration_s", "error"):
            row[key] = a.get(key)
        row["peak_mem_gb"] = a["peak_mem_bytes"] / GB if a.get("peak_mem_bytes") is not None else None
        predicted = a.get("predicted_peak_mem_bytes")
        row["predicted_peak_mem_gb"] = predicted / GB if predicted is not None else None
        rows.append(row)
    return pd.DataFrame(rows, columns=CSV_COLUMNS)


def write_csv(study: optuna.Study, path: Path) -> pd.DataFrame:
    """Write atomically (temp file + rename): a reader never sees half a CSV."""
    frame = trial_rows(study)
    tmp = path.with_suffix(".csv.tmp")
    frame.to_csv(tmp, index=False)
    os.replace(tmp, path)
    return frame
