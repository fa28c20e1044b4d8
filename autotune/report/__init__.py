"""What the engineer reads in the morning: trials.csv, report.html and best/.

    table    trials.csv and the trial table the others read
    answer   which layout to train with, why, what the runner-up costs
    charts   the report's plotly figures
    html     report.html, one self-contained page
    best     best/: the recommended layout for our runtime and other frameworks

trials.csv is rewritten after every trial; report.html and best/ at the end of a
sweep, and `autotune report DIR` writes all three again from the study's storage
alone, without running anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import optuna
import pandas as pd

from autotune.record import Question
from autotune.report.best import write_best
from autotune.report.html import render_report
from autotune.report.table import ranked, trial_table, write_csv


def write_reports(study: optuna.Study, out: Path) -> pd.DataFrame:
    """trials.csv, report.html and best/ (when a trial completed) in `out`; returns the trial
    table they were written from (the CSV's columns and the report's)."""
    out.mkdir(parents=True, exist_ok=True)
    table = trial_table(study)
    write_csv(study, out / "trials.csv", table)
    question = Question.from_study(study)
    write_text(out / "report.html", render_report(study, question, table))
    complete = ranked(table)
    if len(complete):
        write_best(out / "best", question, complete.iloc[0])
    return table


def write_text(path: Path, text: str) -> None:
    """Write atomically (temp file + rename): a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
