"""The stopping rule of a sweep with no budget (autotune/study/stopping.py), alone and in the
study's controller."""

import dataclasses
import importlib.util
import math
from pathlib import Path

import optuna

from autotune.config import load_hardware, load_model
from autotune.plan.space import load_space
from autotune.record import Question
from autotune.study import controller as study_module
from autotune.study import stopping
from autotune.study.stopping import stop_reason, trials_since_improvement


def test_the_count_restarts_only_on_an_improvement_of_one_percent():
    assert trials_since_improvement([]) == (-math.inf, 0)
    assert trials_since_improvement([None, None]) == (-math.inf, 2)
    assert trials_since_improvement([100, None, 100.5, 99]) == (100.5, 3)  # +0.5% is no improvement
    assert trials_since_improvement([100, None, 101, 99]) == (101, 1)  # +1% is


def test_it_stops_after_patience_trials_without_improvement_and_no_contender_left():
    values = [100, 90, None, 80, 95, 70]  # five launches since the best
    assert stop_reason(values, [85, 20], patience=5, margin=0.10) is not None
    assert stop_reason(values, [85, 91], patience=5, margin=0.10) is None  # 91 >= 90: a contender
    assert stop_reason(values, [85], patience=6, margin=0.10) is None  # not patient enough yet
    assert stop_reason(values, [-math.inf], patience=5) is not None  # unknown figures are no contenders


def test_it_never_stops_before_a_trial_completes():
    assert stop_reason([None] * 20, [], patience=5) is None


def test_the_reason_says_what_held():
    reason = stop_reason([100, 50, 50, 50, 50, 50], [], patience=5, improvement=0.01, margin=0.1)
    assert reason.startswith("5 launched trials in a row without improving the best by 1%")
    assert "--exhaustive" in reason


# -- the rule in the study's controller, its launches answered by a table ----------------------

TINY = load_model("tiny")


def _replay_module():
    """benchmarks/replay.py, whose NoClaim serves a controller on an in-memory study."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "replay.py"
    spec = importlib.util.spec_from_file_location("replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NoClaim = _replay_module().NoClaim


def controller(tmp_path, monkeypatch, **question):
    """The controller of a grid sweep of tiny's quick space on 4 GPUs whose first layout runs
    at 1000 tokens/s and every other at 500."""
    tokens = TINY.global_batch_size * TINY.seq_len
    launched = []

    def run_trial(spec, nprocs, timeout_s, log_dir=None, launcher=None):
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        speed = 1000.0 if not launched else 500.0
        launched.append(spec.layout)
        return {"status": "complete", "reason": None, "tokens_per_s": speed, "step_time_s": tokens / speed,
                "comm_fraction": 0.0, "exposed_comm_fraction": 0.0, "world_size": nprocs, "losses": [1.0]}
    monkeypatch.setattr(study_module, "run_trial", run_trial)
    monkeypatch.setattr(study_module, "RankPool", lambda: None)  # every launch through run_trial above
    monkeypatch.setattr(study_module, "write_csv", lambda study, path: None)
    hardware = load_hardware("h100-sxm")
    q = Question(model=dataclasses.asdict(TINY), gpus=4, space=dataclasses.asdict(load_space("quick")),
                 hardware=dataclasses.asdict(hardware), sampler="grid", device="cuda", max_comm_fraction=1.0,
                 **question)
    c = study_module.Controller(q, optuna.create_study(direction="maximize"), tmp_path, NoClaim())
    return c, launched


def test_with_no_budget_the_sweep_stops_by_the_rule(tmp_path, monkeypatch):
    monkeypatch.setattr(stopping, "PATIENCE", 5)  # the mechanism, at constants this small space can show
    monkeypatch.setattr(stopping, "MARGIN", 0.10)
    c, launched = controller(tmp_path, monkeypatch)
    tally = c.run()
    assert tally.stopped.startswith("5 launched trials in a row without improving the best by 1%")
    assert len(launched) == 6 < len(c.layouts)  # the best, then five that did not beat it


def test_exhaustive_trials_and_time_budget_each_say_why_they_stopped(tmp_path, monkeypatch):
    c, launched = controller(tmp_path / "a", monkeypatch, exhaustive=True)
    assert c.run().stopped == "every layout of the space is taken" and len(launched) == len(c.layouts) == 20
    c, launched = controller(tmp_path / "b", monkeypatch, trials=3)
    assert c.run().stopped == "--trials 3 launched" and len(launched) == 3
    c, launched = controller(tmp_path / "c", monkeypatch, time_budget_s=1e-9)
    assert c.run().stopped == "--time-budget 1e-09 s spent" and launched == []


def test_a_small_space_waits_a_quarter_of_its_layouts_at_most():
    assert [stopping.patience_for(n) for n in (4, 12, 20, 40, 41, 294, 5000)] == [3, 3, 5, 10, 10, 10, 10]
