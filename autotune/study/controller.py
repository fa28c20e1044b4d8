"""The study: one Optuna study per results folder, one real trial per layout.

    ask a sampler for an untaken valid layout
      -> price it with the estimator; predicted OOM: pruned, never launched
      -> launch it (a child process group with a wall-clock limit)
      -> measured OOM: pruned/oom; exposed comm over the threshold: pruned/comm_bound;
         crash, error, timeout: failed with the reason; else complete
      -> every figure kept in the trial's user attributes, trials.csv rewritten

The controller never imports the distributed runtime and never joins a process
group: Optuna stays in this process, trials run in children. Running the same
command again (same --out) resumes: finished trials are kept, a trial left running
by a killed controller is measured again, no layout is measured twice.

Several machines share one study through a shared storage (storage.py): `run`
creates it, `autotune worker` joins it and reads the question from it. Each trial
claims its layout under the study's claim lock, running trials beat (Optuna's
heartbeats), and a trial whose worker stopped beating is failed and queued again
(RetryStaleTrial) for whichever worker comes next; a worker with nothing left to
start waits while other trials run, so such a retry is never left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.config import GIB
from autotune.config.trainable import precision_refusal
from autotune.errors import UsageError
from autotune.estimate import Calibration, calibrate, estimate
from autotune.launch.launchers import Launcher, run_trial
from autotune.launch.pool import RankPool
from autotune.plan.layout import Layout
from autotune.plan.space import valid_layouts
from autotune.record import (
    COMM_BOUND,
    COMPLETE,
    CRASH,
    FAILED,
    INTERRUPTED,
    PREDICTED_KEYS,
    PREDICTED_OOM,
    PRUNED,
    RECORDED_KEYS,
    REMEASURED_ATTR,
    Question,
    counts_as_launch,
    holds_layout,
    remeasured_figures,
)
from autotune.report import write_csv, write_reports
from autotune.report.table import ranked
from autotune.study import remeasure, stopping
from autotune.study.optuna_compat import HEARTBEAT_ATTR
from autotune.study.progress import Progress, summary_table
from autotune.study.samplers import (
    GridSampler,
    LayoutSampler,
    ModelSampler,
    RandomSampler,
    TpeSampler,
    layout_from_params,
)
from autotune.study.storage import Claim, load_study, open_storage, optuna_quiet, redact

# A trial's wall-clock limit: generous multiples of its predicted run time, never below a
# floor that covers process start-up, imports and process-group set-up.
TIMEOUT_FLOOR_S = {"cpu": 180.0, "cuda": 600.0}
TIMEOUT_PREDICTION_FACTOR = 5.0
# A trial whose worker died is run again at most this many times, then failed for good.
MAX_RETRIES = 2
# Who runs a trial (the trial's "worker" attribute): this machine and process.
WORKER = f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Tally:
    """Counts and the best trial so far, for the progress display and the summary."""

    complete: int = 0
    pruned: int = 0
    failed: int = 0
    launched: int = 0
    best: dict | None = None
    last: dict | None = None
    started: float = field(default_factory=time.monotonic)
    stopped: str | None = None  # why the sweep stopped, when it did by itself


def open_study(question: Question, out: Path, storage: str | None, study_name: str | None) -> optuna.Study:
    """Create the study, or load it when this folder (or storage) already holds it. In a
    shared storage the study is returned with heartbeats on (join_study)."""
    url = storage or f"sqlite:///{out / 'study.db'}"
    name = study_name or f"{question.model['name']}-{question.gpus}gpus"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=open_storage(url), direction="maximize",
                                load_if_exists=True)
    stored = study.user_attrs.get("question")
    if stored is None:
        study.set_user_attr("question", question.to_dict())
    elif Question.from_dict(stored).identity() != question.identity():
        where = f"--out {out}" if storage is None else f"--study-name {name} in --storage {redact(storage)}"
        raise UsageError(f"{where}: holds a study of another question (model, gpus, space, device or "
                         f"objective differ); give another --out or --study-name")
    if storage is None:
        return study
    return join_study(storage, name, Question.from_study(study).heartbeat_s)


def join_study(storage: str, study_name: str, heartbeat_s: int) -> optuna.Study:
    """The study on a storage whose running trials beat every heartbeat_s seconds, and whose
    stale trials (their worker died) are retried. Every worker uses the study's own interval:
    a worker that expected beats more often would fail live trials of the others."""
    storage_object = open_storage(storage, heartbeat_s=heartbeat_s, stale_callback=RetryStaleTrial())
    return optuna.load_study(study_name=study_name, storage=storage_object)


class RetryStaleTrial:
    """Optuna's retry of a stale trial (queued again as WAITING, with its layout), at most
    MAX_RETRIES times; after that the layout gets an outcome of its own, failed/crash, so a
    layout that keeps killing its workers is not handed out forever."""

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        trial.system_attrs.pop(HEARTBEAT_ATTR, None)  # the retry beats afresh (journal storage)
        with optuna_quiet():
            retried = len(optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(trial))
            if retried < MAX_RETRIES:
                optuna.storages.RetryHeartbeatStaleTrialCallback()(study, trial)
                return
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.FAIL, params=trial.params, distributions=trial.distributions,
            user_attrs={**trial.user_attrs, "status": FAILED, "reason": CRASH,
                        "error": f"its worker stopped (no heartbeat) on each of {retried + 1} attempts, "
                                 f"the last {trial.user_attrs.get('worker', '')}"}))


def make_sampler(question: Question, layouts: list[Layout], study_score) -> LayoutSampler:
    if question.sampler == "grid":
        return GridSampler(layouts, question.seed)
    if question.sampler == "random":
        return RandomSampler(layouts, question.seed)
    if question.sampler == "tpe":
        return TpeSampler(layouts, question.seed)
    return ModelSampler(layouts, study_score, question.seed)


class Controller:
    """Runs trials of one study until the budget is spent or every layout is taken.

    shared: other workers may use the study (a shared storage with heartbeats); then a
    worker with nothing to start waits while their trials run."""

    def __init__(self, question: Question, study: optuna.Study, out: Path, claim: Claim, progress=None,
                 launcher: Launcher | None = None, shared: bool = False):
        self.q = question
        self.study = study
        self.out = out
        self.claim = claim
        self.shared = shared
        self.model = question.model_config
        self.hardware = question.hardware_config
        # Layouts the runtime cannot train in this precision (fp16 under PP) are no candidates.
        self.layouts = [layout for layout in valid_layouts(self.model, question.gpus, question.space_config,
                                                            question.scale_up)
                        if precision_refusal(question.trained_model, layout.pp) is None]
        if not self.layouts:
            raise UsageError(f"space {question.space_config.name}: every valid layout needs pp > 1, which "
                             f"--dtype fp16 does not train; use bf16 or a space with pp=1")
        self.budget_bytes = question.memory_budget_gb * GIB if question.memory_budget_gb else None
        self.sampler = make_sampler(question, self.layouts, self.scorer)
        study.sampler = self.sampler  # the sampler depends on the layouts, known only now
        self.launcher = launcher or Launcher(question.launcher, question.gpus_per_node)
        self.launcher.check(question.gpus)
        # A local sweep's trials run on warm processes (pool.py); other launchers start fresh ones.
        self.pool = RankPool() if self.launcher.kind == "local" else None
        self.progress = progress
        self.tally = Tally()

    # -- the estimator, calibrated on what has been measured --------------------------------
    def calibration(self) -> Calibration | None:
        """Fit the estimator to the trials measured so far (None before the first).

        A CPU has no peak FLOP/s in its preset: the trials measure it (a calibration
        GEMM), and the estimator takes their median from the first measured trial on."""
        measured = [(self.sampler.by_name[t.user_attrs["layout"]], t.user_attrs) for t in self.study.get_trials(
            deepcopy=False) if t.user_attrs.get("tokens_per_s") and t.user_attrs.get("layout") in self.sampler.by_name]
        if not measured:
            return None
        if not self.hardware.peak_tflops:
            peaks = [attrs["peak_tflops"] for _, attrs in measured if attrs.get("peak_tflops")]
            if peaks:
                self.hardware = dataclasses.replace(self.hardware, peak_tflops=statistics.median(peaks))
        return calibrate(measured, self.model, self.hardware, device=self.q.device, dtype=self.q.dtype,
                         grad_dtype=self.q.grad_dtype)

    def predict(self, layout: Layout, calibration: Calibration | None = None):
        return estimate(self.model, layout, self.hardware, self.budget_bytes, calibration, device=self.q.device,
                        dtype=self.q.dtype, grad_dtype=self.q.grad_dtype)

    def scorer(self, study: optuna.Study):
        """Sort key for the model sampler: layouts predicted to fit first, then by prediction."""
        calibration = self.calibration()

        def score(layout: Layout):
            e = self.predict(layout, calibration)
            value = e.mfu if self.q.objective == "mfu" else e.tokens_per_s
            return (e.fits, value if math.isfinite(value) else -math.inf)  # unknown time: space order
        return score

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> Tally:
        """Run trials until --trials launches in the whole study, --time-budget seconds of this
        process, or no layout is left to start.

        Each trial is one call of Optuna's `optimize`, so a shared storage's heartbeats and
        stale-trial retries work. It starts under the claim: no other worker chooses a layout
        between the check that one is left and the trial's layout attribute being written
        (the objective releases the claim there); stale trials are failed and queued again
        under the claim too, so a retried layout is never free in between."""
        self.recount()
        deadline = None if self.q.time_budget_s is None else time.monotonic() + self.q.time_budget_s
        told_waiting = False
        while not self.out_of_time(deadline):
            self.claim.acquire()
            try:
                if self.shared:
                    with optuna_quiet():
                        optuna.storages.fail_stale_trials(self.study)
                trials = self.study.get_trials(deepcopy=False)
                if self.can_start(trials):
                    self.study.optimize(self.objective, n_trials=1, catch=(TrialFailed,), gc_after_trial=False)
                    told_waiting = False
                    continue
            finally:
                self.claim.release()
            running = [t.number for t in trials if t.state == TrialState.RUNNING]
            if not (self.shared and running):
                break
            self.tally.stopped = None  # trials elsewhere may still change it
            if self.progress and not told_waiting:
                self.progress.console.print(f"waiting: nothing left to start while trials {running} run elsewhere "
                                            f"(a trial whose worker dies is retried here)", highlight=False)
                told_waiting = True
            time.sleep(min(self.q.heartbeat_s, 10))
        return self.tally

    def remeasure_leaders(self) -> int:
        """Run the leading complete layouts again in fresh processes (remeasure.py); the runs
        that complete join the trial's figures. Returns how many layouts were run again."""
        done = dict(self.study.user_attrs.get(REMEASURED_ATTR, {}))
        leaders = remeasure.leaders(self.study.get_trials(deepcopy=False), self.q.confirm, done)
        for i, t in enumerate(leaders):
            layout = self.sampler.by_name.get(t.user_attrs["layout"])
            if layout is None:
                continue
            if self.progress:
                self.progress.console.print(f"re-measuring trial {t.number} ({layout.short()}) in fresh processes, "
                                            f"{i + 1} of {len(leaders)}", highlight=False)
            record = self.launch(t.number, layout, self.predict(layout, self.calibration()), again=True)
            if record["status"] == COMPLETE:
                done[str(t.number)] = done.get(str(t.number), []) + [remeasured_figures(record)]
            elif self.progress:
                self.progress.console.print(f"trial {t.number} measured again: {record['status']}/"
                                            f"{record.get('reason')} ({record.get('error', '')}); its first "
                                            f"figures stand", highlight=False)
            self.study.set_user_attr(REMEASURED_ATTR, done)
        return len(leaders)

    def out_of_time(self, deadline: float | None) -> bool:
        if deadline is None or time.monotonic() < deadline:
            return False
        self.tally.stopped = f"--time-budget {self.q.time_budget_s:g} s spent"
        return True

    def can_start(self, trials: list) -> bool:
        """A retry is queued, or an untaken layout is left, the launch budget is not spent
        and, with no budget at all, the stopping rule (stopping.py) does not say stop."""
        if any(t.state == TrialState.WAITING for t in trials):
            return True
        taken = {t.user_attrs["layout"] for t in trials if holds_layout(t)}
        untaken = [layout for layout in self.layouts if str(layout) not in taken]
        if not untaken:
            self.tally.stopped = "every layout of the space is taken"
            return False
        if self.q.trials is not None:
            if self.launches(trials) < self.q.trials:
                return True
            self.tally.stopped = f"--trials {self.q.trials} launched"
            return False
        if self.q.time_budget_s is not None or self.q.exhaustive:
            return True
        self.tally.stopped = self.stop_reason(trials, untaken)
        return self.tally.stopped is None

    def stop_reason(self, trials: list, untaken: list[Layout]) -> str | None:
        """The stopping rule on this study: launched trials in order, and the calibrated
        estimator's figure for each untaken layout predicted to fit."""
        launched = sorted((t for t in trials if counts_as_launch(t) and t.user_attrs.get("status")),
                          key=lambda t: t.number)
        values = [t.value if t.state == TrialState.COMPLETE else None for t in launched]
        patience = stopping.patience_for(len(self.layouts))
        if stopping.trials_since_improvement(values)[1] < patience:
            return None  # cheap test first: the estimator is consulted only when it may stop
        score = self.scorer(self.study)  # the model sampler's (fits, predicted objective)
        return stopping.stop_reason(values, [value for fits, value in map(score, untaken) if fits], patience)

    @staticmethod
    def launches(trials: list) -> int:
        """Trials of the study that launched or may launch (record.counts_as_launch)."""
        return sum(map(counts_as_launch, trials))

    def objective(self, trial: optuna.Trial) -> float:
        params = {key: trial.suggest_categorical(key, dist.choices)
                  for key, dist in self.sampler.distributions.items()}
        layout = layout_from_params(self.sampler, params)
        trial.set_user_attr("layout", str(layout))
        trial.set_user_attr("worker", WORKER)
        self.claim.release()  # the layout is claimed: other workers may choose now
        trial.set_user_attr("layout_short", layout.short())
        predicted = self.predict(layout, self.calibration())
        for key in PREDICTED_KEYS:
            trial.set_user_attr(f"predicted_{key}", getattr(predicted, key))
        if not predicted.fits:
            return self.finish(trial, PRUNED, PREDICTED_OOM, {"error": (
                f"predicted peak {predicted.peak_mem_bytes / GIB:.2f} GiB over the budget of "
                f"{self.budget_bytes / GIB:.2f} GiB")})
        if self.progress:
            self.progress.trial_started(trial.number, layout.short())
        try:
            record = self.launch(trial.number, layout, predicted)
        except KeyboardInterrupt:
            self.finish(trial, FAILED, INTERRUPTED, {"error": "the controller was interrupted (Ctrl-C)"},
                        raise_=False)
            raise
        self.tally.launched += 1
        status, reason = record["status"], record.get("reason")
        exposed = record.get("exposed_comm_fraction")
        if status == COMPLETE and exposed is not None and exposed > self.q.max_comm_fraction:
            status, reason = PRUNED, COMM_BOUND
            record["error"] = (f"exposed communication {exposed:.0%} of the step, over the threshold of "
                               f"{self.q.max_comm_fraction:.0%}")
        return self.finish(trial, status, reason, record)

    def launch(self, number: int, layout: Layout, predicted, again: bool = False) -> dict:
        spec = self.q.trial_spec(str(layout))
        predicted_run = predicted.step_time_s * (self.q.steps + self.q.warmup)
        floor = TIMEOUT_FLOOR_S[self.q.device]
        timeout = max(floor, TIMEOUT_PREDICTION_FACTOR * predicted_run) if math.isfinite(predicted_run) else floor
        timeout = self.q.trial_timeout_s or timeout
        trial_dir = self.out / "trials" / str(number)
        if again:  # a re-measurement, in fresh processes: its own logs beside the first run's
            trial_dir = trial_dir / f"again-{len(list(trial_dir.glob('again-*'))) + 1}"
        record = None
        if self.pool is not None and not again:
            record = self.pool.run(spec, self.q.gpus, timeout, trial_dir)
            if record["status"] != COMPLETE:
                # The pool was replaced; the outcome that is kept is a fresh launch's, so that
                # nothing a warm process carried from an earlier trial can fail a layout.
                (trial_dir / "pooled").mkdir(exist_ok=True)
                for name in ("stdout.log", "stderr.log"):
                    if (trial_dir / name).exists():
                        os.replace(trial_dir / name, trial_dir / "pooled" / name)
                record = None
        if record is None:
            record = run_trial(spec, self.q.gpus, timeout_s=timeout, log_dir=trial_dir, launcher=self.launcher)
        (trial_dir / "result.json").write_text(json.dumps(record, indent=2))
        return record

    def finish(self, trial: optuna.Trial, status: str, reason: str | None, record: dict,
               raise_: bool = True) -> float:
        """Keep every figure in the trial's attributes, then end it in Optuna's terms:
        complete returns the objective, pruned raises TrialPruned, failed TrialFailed."""
        attrs = {"status": status, "reason": reason}
        attrs.update({key: record[key] for key in RECORDED_KEYS if record.get(key) is not None})
        if record.get("error"):
            attrs["error"] = str(record["error"])[:2000]
        if record.get("stderr_tail"):
            attrs["stderr_tail"] = record["stderr_tail"][-4000:]
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        value = record.get(self.q.objective) if status == COMPLETE else None
        self.count(status, {**trial.user_attrs, **attrs}, value)
        write_csv(self.study, self.out / "trials.csv")
        if self.progress:
            self.progress.trial_finished(self.tally)
        if not raise_:
            return float("nan")
        if status == COMPLETE:
            return value
        if status == PRUNED:
            raise optuna.TrialPruned(attrs.get("error", reason))
        raise TrialFailed(f"{reason}: {attrs.get('error', '')}")

    def count(self, status: str, attrs: dict, value: float | None) -> None:
        if status == COMPLETE:
            self.tally.complete += 1
        elif status == PRUNED:
            self.tally.pruned += 1
        else:
            self.tally.failed += 1
        self.tally.last = dict(attrs)
        if value is not None and (self.tally.best is None or value > self.tally.best["value"]):
            self.tally.best = {"value": value, **attrs}

    def recount(self) -> None:
        """Start the tally from what the study already holds (a resumed sweep)."""
        for t in self.study.get_trials(deepcopy=False):
            status = t.user_attrs.get("status")
            if status is not None and t.user_attrs.get("reason") != INTERRUPTED:
                self.count(status, t.user_attrs, t.value if t.state == TrialState.COMPLETE else None)
            self.tally.launched += counts_as_launch(t)  # --trials counts launches over every run of the study


class TrialFailed(Exception):
    """A trial that crashed, raised or timed out: Optuna records it as FAIL and goes on."""


def fail_abandoned_trials(study: optuna.Study) -> int:
    """Mark RUNNING trials failed: only safe when no other controller uses this storage
    (the results folder's lock says so). Their layouts are then measured again."""
    abandoned = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in abandoned:
        study.tell(t.number, state=TrialState.FAIL)
    return len(abandoned)


@contextlib.contextmanager
def results_folder(out: Path, exclusive: bool):
    """Create the folder and, for a study stored in it, hold its lock: one controller
    per local study, so trials it finds RUNNING were abandoned by a killed controller."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write there ({e.strerror})") from None
    if not exclusive:
        yield
        return
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UsageError(f"--out {out}: another autotune run is using this folder") from None
        yield


def run_sweep(question: Question, out: Path, storage: str | None = None, study_name: str | None = None,
              console=None, hosts: tuple[str, ...] = ()) -> int:
    """`autotune run`: open or resume the study, run trials, write the results. Returns the
    exit code (0, or 130 when interrupted with Ctrl-C: the running trial is killed and
    marked, the CSV written, and the next run resumes)."""
    with results_folder(out, exclusive=storage is None):
        study = open_study(question, out, storage, study_name)
        if storage is None:
            fail_abandoned_trials(study)
        title = (f"{question.model['name']} on {question.gpus} {question.device} GPUs · space "
                 f"{question.space['name']} · sampler {question.sampler} · {out}")
        launcher = Launcher(question.launcher, question.gpus_per_node, tuple(hosts))
        claim = Claim(storage or f"sqlite:///{out / 'study.db'}", study.study_name)
        return sweep(Controller(question, study, out, claim, launcher=launcher, shared=storage is not None),
                     title, "run the same command to resume", console, remeasure_leaders=True)


def run_worker(storage: str, study_name: str, out: Path | None = None, launcher: str | None = None,
               hosts: tuple[str, ...] = (), console=None) -> int:
    """`autotune worker`: join a study that `run` created on a shared storage, read the
    question from it, and run its trials on this machine's GPUs (or nodes) until the
    budget is spent or every layout has an outcome."""
    plain = load_study(out or Path("."), storage, study_name)  # a missing study is bad input
    question = Question.from_study(plain)
    out = out or Path("results") / plain.study_name
    with results_folder(out, exclusive=False):
        study = join_study(storage, plain.study_name, question.heartbeat_s)
        title = (f"worker {WORKER} · study {plain.study_name}: {question.model['name']} on {question.gpus} "
                 f"{question.device} GPUs · space {question.space['name']} · {out}")
        launch = Launcher(launcher or question.launcher, question.gpus_per_node, tuple(hosts))
        return sweep(Controller(question, study, out, Claim(storage, plain.study_name), launcher=launch,
                                shared=True), title, "start the worker again to go on", console)


def sweep(controller: Controller, title: str, resume_hint: str, console=None, remeasure_leaders: bool = False) -> int:
    """Run the controller with progress on stderr, then (`autotune run`, not a worker) the
    leading layouts again, then write trials.csv, report.html and best/."""
    from rich.console import Console

    console = console or Console(stderr=True)
    q, out = controller.q, controller.out
    interrupted = False
    try:
        with Progress(title, q.objective, len(controller.layouts), q.trials, q.time_budget_s, console) as progress:
            controller.progress = progress
            try:
                controller.run()
                if controller.pool is not None:
                    controller.pool.close()  # the cores are the re-measurements' now
                if remeasure_leaders:
                    controller.remeasure_leaders()
            except KeyboardInterrupt:
                interrupted = True
    finally:
        controller.claim.close()
        if controller.pool is not None:
            controller.pool.close()
    stopped = None if interrupted else controller.tally.stopped
    if stopped:
        controller.study.set_user_attr("stopped", stopped)  # the report says it too
    frame = write_reports(controller.study, out)  # trials.csv, report.html, best/
    console.print(summary_table(frame, q.objective))
    if interrupted:
        console.print(f"interrupted: {out / 'trials.csv'} is written; {resume_hint}")
        return 130
    if stopped:
        console.print(f"stopped: {stopped}")
    complete = ranked(frame)  # re-measured trials at the median of their runs
    if len(complete):
        best = complete.iloc[0]
        confirmed = ", confirmed" if best["confirmed"] else ""
        console.print(f"best: {best['layout_short']}  ({best['value']:,.4g} {q.objective}{confirmed})")
    console.print(f"results: {out / 'trials.csv'} · report: {out / 'report.html'}")
    return 0
