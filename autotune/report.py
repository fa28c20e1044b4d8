"""What the engineer reads in the morning: trials.csv, report.html and best/.

trials.csv has one row per trial in every state, with stable columns (README,
"Results"); it is rewritten after every trial so an interrupted sweep still has it.
report.html and best/ are written at the end of a sweep, and `autotune report DIR`
writes all three again from the study's storage alone, without running anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import optuna
import pandas as pd
from optuna.trial import TrialState

from autotune.errors import UsageError
from autotune.layout import INT_KEYS, STR_KEYS, Layout, parse_layout
from autotune.storage import one_line, open_storage, redact

LAYOUT_COLUMNS = ["tp", "pp", "cp", "ep", "dp", "dp_shard", "zero", "mbs", "schedule", "vpp", "recompute", "sp"]
CSV_COLUMNS = (["trial", "status", "reason"] + LAYOUT_COLUMNS +
               ["grad_accum", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s", "peak_mem_gb",
                "predicted_peak_mem_gb", "comm_fraction", "exposed_comm_fraction", "predicted_tokens_per_s",
                "duration_s", "error"])
# Columns the HTML report uses besides the CSV's (not in the CSV: its columns are a contract).
EXTRA_COLUMNS = ["layout", "layout_short", "value", "world_size", "predicted_step_time_s", "predicted_mfu",
                 "predicted_comm_fraction", "stderr_tail"]
GB = 1024 ** 3
STATE_STATUS = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
                TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}
assert set(LAYOUT_COLUMNS) == set(INT_KEYS + STR_KEYS)


def trial_table(study: optuna.Study) -> pd.DataFrame:
    """Every trial with the CSV's columns and the report's extra ones."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        row = {"trial": t.number, "status": a.get("status") or STATE_STATUS[t.state],
               "reason": a.get("reason") or ("interrupted" if t.state == TrialState.FAIL else None)}
        row.update(parse_layout(a["layout"]) if "layout" in a else {})
        for key in ("grad_accum", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_s", "comm_fraction",
                    "exposed_comm_fraction", "predicted_tokens_per_s", "duration_s", "error", "world_size",
                    "predicted_step_time_s", "predicted_mfu", "predicted_comm_fraction", "stderr_tail"):
            row[key] = a.get(key)
        row["peak_mem_gb"] = a["peak_mem_bytes"] / GB if a.get("peak_mem_bytes") is not None else None
        predicted = a.get("predicted_peak_mem_bytes")
        row["predicted_peak_mem_gb"] = predicted / GB if predicted is not None else None
        row["layout"] = a.get("layout")
        row["layout_short"] = a.get("layout_short") or (
            Layout(**parse_layout(a["layout"])).short() if "layout" in a else None)
        row["value"] = t.value if t.state == TrialState.COMPLETE else None
        rows.append(row)
    return pd.DataFrame(rows, columns=CSV_COLUMNS + EXTRA_COLUMNS)


def trial_rows(study: optuna.Study) -> pd.DataFrame:
    return trial_table(study)[CSV_COLUMNS]


def write_csv(study: optuna.Study, path: Path) -> pd.DataFrame:
    """Write atomically (temp file + rename): a reader never sees half a CSV."""
    frame = trial_rows(study)
    tmp = path.with_suffix(".csv.tmp")
    frame.to_csv(tmp, index=False)
    os.replace(tmp, path)
    return frame


def write_reports(study: optuna.Study, out: Path) -> pd.DataFrame:
    """trials.csv, report.html and best/ (when a trial completed) in `out`; returns the CSV's frame."""
    from autotune.export import write_best
    from autotune.report_html import render_report

    out.mkdir(parents=True, exist_ok=True)
    frame = write_csv(study, out / "trials.csv")
    table = trial_table(study)
    question = study.user_attrs["question"]
    write_text(out / "report.html", render_report(study, question, table))
    complete = table[table["status"] == "complete"]
    if len(complete):
        best = complete.sort_values(["value", "trial"], ascending=[False, True]).iloc[0]
        write_best(out / "best", question, best)
    return frame


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def load_study(folder: Path, storage: str | None = None, study_name: str | None = None) -> optuna.Study:
    """The autotune study in `folder`'s study.db (or in --storage), opened read-only in
    spirit: nothing is created, a missing study is bad input."""
    if storage is None:
        db = folder / "study.db"
        if not db.is_file():
            raise UsageError(f"DIR {folder}: no study here (no study.db; give --storage for a shared storage)")
        storage = f"sqlite:///{db}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url, storage = storage, open_storage(storage)  # bad input in one line, without the password
    try:
        names = optuna.get_all_study_names(storage)
    except Exception as e:  # a storage that opened but cannot be read: the driver's own words
        raise UsageError(f"--storage {redact(url)}: cannot read it ({one_line(e, url)})") from None
    if study_name is None:
        if len(names) != 1:
            found = f"it holds {', '.join(names)}" if names else "it holds none"
            raise UsageError(f"--study-name: needed to pick one study ({found})")
        study_name = names[0]
    elif study_name not in names:
        raise UsageError(f"--study-name: no study {study_name!r} in the storage "
                         f"(it holds {', '.join(names) or 'none'})")
    study = optuna.load_study(study_name=study_name, storage=storage)
    if "question" not in study.user_attrs:
        raise UsageError(f"--study-name: study {study_name!r} was not created by autotune run (no question)")
    return study
