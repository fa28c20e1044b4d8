"""Drive the shipped study controller with every launch answered from a table.

The sampler benchmarks measure autotune/study/controller.py's Controller and autotune/study/samplers.py
as `autotune run` uses them, on an in-memory Optuna study: the controller asks the
sampler, prunes predicted OOMs before launch, applies the communication threshold and
calibrates the estimator on what was measured. Only `run_trial` is replaced, by a look-up
of the layout's record (what a launch would have returned), as tests/fake_trials.py
does. Nothing else of the table reaches the samplers.

Three stand-ins save time and change no decision: the CSV is not written, the space's
layouts are enumerated once, and a calibration is computed once per set of measured
trials (calibrate is a function of them).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import optuna

from autotune.estimate import calibrate
from autotune.plan.layout import Layout
from autotune.study import controller as study_module


class NoClaim:
    """One controller per in-memory study: nothing to lock."""

    def acquire(self):
        pass

    def release(self):
        pass

    def close(self):
        pass


class Replay:
    """The launch as a look-up in `records` (layout string -> the record run_trial returns)."""

    def __init__(self, layouts: list[Layout], records: dict[str, dict] | None = None):
        self.layouts = layouts
        self.records = records or {}
        self.calibrations: dict = {}
        study_module.run_trial = self.run_trial
        study_module.RankPool = lambda: None  # every launch through the look-up, no warm pool
        study_module.write_csv = lambda study, path: None
        study_module.valid_layouts = lambda model, gpus, space, gpus_per_node=None: self.layouts
        study_module.calibrate = self.calibrate

    def run_trial(self, spec, nprocs, timeout_s, log_dir=None, launcher=None):
        Path(log_dir).mkdir(parents=True, exist_ok=True)  # the controller writes result.json there
        return dict(self.records[spec.layout])

    def calibrate(self, measured, model, hardware, device="cuda", dtype=None, grad_dtype=None):
        key = (hardware.peak_tflops, dtype, grad_dtype) + tuple(
            (str(layout), t.get("status"), t.get("reason"), t.get("step_time_s"), t.get("comm_fraction"),
             t.get("exposed_comm_fraction"), t.get("peak_mem_bytes")) for layout, t in measured)
        if key not in self.calibrations:
            self.calibrations[key] = calibrate(measured, model, hardware, device=device, dtype=dtype,
                                               grad_dtype=grad_dtype)
        return self.calibrations[key]

    @staticmethod
    def check_unique(study) -> None:
        """The samplers' promise: no layout is taken twice."""
        names = [t.user_attrs["layout"] for t in study.get_trials(deepcopy=False) if "layout" in t.user_attrs]
        if len(names) != len(set(names)):
            raise AssertionError(f"a layout was proposed twice: {sorted(n for n in set(names) if names.count(n) > 1)}")

    def trials_to_target(self, question, target: float, cap: int) -> tuple[int | None, list]:
        """Launched trials until the first complete one whose objective is at least target
        (None: not within cap launches, or every layout taken first), and the study's trials."""
        self.calibrations.clear()
        question = dataclasses.replace(question, trials=0)
        study = optuna.create_study(direction="maximize")
        with tempfile.TemporaryDirectory() as out:
            controller = study_module.Controller(question, study, Path(out), NoClaim())
            for k in range(1, cap + 1):
                question.trials = k  # one more launch per run(): the controller's own budget check
                controller.run()
                self.check_unique(study)
                if controller.launches(study.get_trials(deepcopy=False)) < k:
                    break  # every layout taken
                best = controller.tally.best
                if best is not None and best["value"] >= target:
                    return k, study.get_trials(deepcopy=False)
        return None, study.get_trials(deepcopy=False)
