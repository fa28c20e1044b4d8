"""autotune run end to end on the CPU: outcomes, pruning, failures, resume."""

import os
import signal
import subprocess
import sys
import time

import optuna
import pandas as pd

from autotune.report.table import CSV_COLUMNS

RUN = [sys.executable, "-m", "autotune", "run", "--model", "tiny", "--space", "quick"]


def autotune_run(*args, env=None, timeout=600):
    out = subprocess.run(RUN + list(args), capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    return out


def read_csv(out_dir):
    return pd.read_csv(out_dir / "trials.csv")


def study_trials(out_dir):
    (name,) = optuna.get_all_study_names(f"sqlite:///{out_dir / 'study.db'}")
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out_dir / 'study.db'}").get_trials()


def test_run_end_to_end(tmp_path):
    out_dir = tmp_path / "sweep"
    result = autotune_run("--gpus", "4", "--trials", "4", "--steps", "2", "--warmup", "1", "--confirm", "1",
                          "--out", str(out_dir))
    assert result.returncode == 0, result.stderr
    frame = read_csv(out_dir)
    assert list(frame.columns) == CSV_COLUMNS
    assert len(frame) == len(study_trials(out_dir)) >= 4
    launched = frame[frame["reason"] != "predicted_oom"]
    assert len(launched) == 4
    complete = frame[frame["status"] == "complete"]
    assert len(complete) >= 1 and (complete["tokens_per_s"] > 0).all()
    # the leader was measured again in fresh processes: its steps are both runs' (2 + 2)
    (leader,) = frame[frame["confirmed"] == 1].itertuples()
    first_best = max((t for t in study_trials(out_dir) if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert leader.trial == first_best.number
    assert (out_dir / "trials" / str(leader.trial) / "again-1" / "result.json").exists()
    assert "re-measuring trial" in result.stderr
    assert (complete["step_time_min_s"] <= complete["step_time_s"]).all()
    assert (complete["step_time_s"] <= complete["step_time_max_s"]).all()
    best = (out_dir / "best" / "layout.txt").read_text()
    best_row = complete.sort_values("tokens_per_s").iloc[-1]
    assert f"tp={best_row['tp']}," in best and f"mbs={best_row['mbs']}" in best
    assert (out_dir / "report.html").stat().st_size > 100_000
    assert "best:" in result.stderr


def test_tiny_budget_prunes_every_layout_before_launch(tmp_path):
    out_dir = tmp_path / "tiny-budget"
    result = autotune_run("--gpus", "4", "--memory-budget-gb", "0.0001", "--out", str(out_dir))
    assert result.returncode == 0, result.stderr
    frame = read_csv(out_dir)
    assert len(frame) == 20  # every valid layout of the quick space at 4 GPUs, none launched
    assert set(zip(frame["status"], frame["reason"])) == {("pruned", "predicted_oom")}
    assert frame["predicted_peak_mem_gb"].gt(0.0001).all()
    assert frame["error"].str.contains("over the budget").all()
    assert not (out_dir / "trials").exists()


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def test_resume_after_sigkill_measures_no_layout_twice(tmp_path):
    out_dir = tmp_path / "resume"
    args = RUN + ["--gpus", "2", "--sampler", "grid", "--trials", "4", "--steps", "1", "--warmup", "0",
                  "--confirm", "0", "--out", str(out_dir)]  # figures as first measured: none re-measured
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def finished_trials():
        path = out_dir / "trials.csv"
        return len(pd.read_csv(path)) if path.exists() and path.stat().st_size else 0

    # Kill the controller while its third trial runs (two finished, the third launched).
    assert wait_for(lambda: finished_trials() >= 2 and (out_dir / "trials" / "2").exists(), 300)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = read_csv(out_dir)
    finished_before = before[before["status"].isin(["complete", "pruned", "failed"])]

    second = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    after = read_csv(out_dir)
    layout_cols = ["tp", "pp", "zero", "mbs", "sp"]
    measured = after[after["reason"] != "interrupted"]
    # Every trial finished before the kill is kept, once, with the same figures.
    kept = measured.set_index("trial").loc[finished_before["trial"]]
    assert (kept["tokens_per_s"].values == finished_before["tokens_per_s"].values).all()
    # No layout measured twice, and the budget of 4 launches was completed.
    assert not measured.duplicated(subset=layout_cols).any()
    launched = measured[measured["reason"] != "predicted_oom"]
    assert len(launched) >= 4
    # The trial the kill interrupted is failed and its layout measured again.
    abandoned = after[after["reason"] == "interrupted"]
    assert len(abandoned) == 1
    measured_layouts = set(map(tuple, measured[layout_cols].values.tolist()))
    assert tuple(abandoned[layout_cols].values.tolist()[0]) in measured_layouts
