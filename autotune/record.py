"""The study's record: the question it answers, the outcome vocabulary, the metric names.

Pure Python (no Optuna, no torch): the controller writes these, the reports, the
exports and the workers read them, and every one of them reads them from here.

Outcomes, one vocabulary everywhere (a trial's JSON, Optuna user attributes, the CSV,
the report):

    complete                measured
    pruned / predicted_oom  the estimator says it cannot fit: never launched
    pruned / oom            ran out of memory (real, or its peak over the budget)
    pruned / comm_bound     exposed communication over --max-comm-fraction; figures kept
    failed / timeout        exceeded its wall-clock limit; its process tree was killed
    failed / crash          a rank died (signal, exit code)
    failed / error          a Python exception; its last lines kept
    failed / interrupted    the controller was stopped during it: measured again on resume

(A layout that breaks a rule is never proposed: the samplers choose among valid layouts
only, and `autotune trial` refuses one with exit code 2.)
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Required, TypedDict

from autotune.config import HardwareConfig, ModelConfig, as_trained, hardware_from_dict, model_from_dict
from autotune.plan.space import Space
from autotune.trialspec import TrialSpec

if TYPE_CHECKING:  # optuna loads for seconds: only the commands that run a study import it
    import optuna

# A trial ends complete, pruned (it cannot win: over the memory budget, communication-bound)
# or failed (it did not finish), with a reason for the last two (docs/results.md).
Status = Literal["complete", "pruned", "failed"]
Reason = Literal["predicted_oom", "oom", "comm_bound", "timeout", "crash", "error", "interrupted"]
COMPLETE: Final[Status] = "complete"
PRUNED: Final[Status] = "pruned"
FAILED: Final[Status] = "failed"
PREDICTED_OOM: Final[Reason] = "predicted_oom"
OOM: Final[Reason] = "oom"
COMM_BOUND: Final[Reason] = "comm_bound"
TIMEOUT: Final[Reason] = "timeout"
CRASH: Final[Reason] = "crash"
ERROR: Final[Reason] = "error"
INTERRUPTED: Final[Reason] = "interrupted"


class TrialResult(TypedDict, total=False):
    """A trial's result JSON (`autotune trial --json`, runtime/trial.py), as the study and
    the reports read it. A failed trial holds the first four keys and the launcher's
    account of the failure; a measured one the rest, each metric as its definition says
    (runtime/trial.py's measurements)."""

    status: Required[Status]
    reason: Required[Reason | None]
    error: str
    layout: str
    model: str
    world_size: int
    grad_accum: int
    device: str
    steps: int
    warmup: int
    dtype: str
    losses: list[float]
    precision_emulated: bool | None
    memory_budget_bytes: float | None
    torch_version: str
    ep_token_imbalance: dict[str, float] | None
    step_times_s: list[float]
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    flops_per_token: float
    peak_tflops: float
    peak_tflops_source: str
    mfu: float
    peak_mem_bytes: int
    memory_source: str
    reserved_mem_bytes: int | None
    comm_fraction: float
    comm_fraction_mean: float
    exposed_comm_fraction: float
    exposed_comm_fraction_mean: float
    duration_s: float

# Exposed communication above this share of the step prunes a layout (the practitioners' rule of
# thumb: a step spending more than 30% communicating is cut too finely).
DEFAULT_MAX_COMM_FRACTION = 0.30
OBJECTIVES = ("tokens_per_s", "mfu")
SAMPLER_NAMES = ("model", "tpe", "grid", "random")

# A trial's figures (README "Metrics"), as its JSON names them. The profiled ones need
# torch.profiler; a trial run without it (numerics tests) reports step times only.
PROFILED_METRICS = ("peak_mem_bytes", "comm_fraction", "exposed_comm_fraction")
METRICS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu") + PROFILED_METRICS
# What the study keeps of a trial's JSON in its Optuna user attributes: the metrics and
# the facts needed to read them.
RECORDED_KEYS = METRICS + ("grad_accum", "world_size", "duration_s", "peak_tflops", "losses", "step_times_s",
                           "reserved_mem_bytes")
# The estimator's prediction of each, kept as predicted_<name>.
PREDICTED_KEYS = ("peak_mem_bytes", "tokens_per_s", "step_time_s", "mfu", "comm_fraction")


@dataclass
class Question:
    """What the user asked: stored with the study so `report` and `worker` can read it."""

    model: dict[str, Any]  # ModelConfig fields
    gpus: int
    space: dict[str, Any]  # Space fields
    hardware: dict[str, Any]  # HardwareConfig fields
    objective: str = "tokens_per_s"
    sampler: str = "model"
    max_comm_fraction: float = DEFAULT_MAX_COMM_FRACTION
    memory_budget_gb: float | None = None
    device: str = "cpu"
    steps: int = 5
    warmup: int = 2
    seed: int = 0
    gpus_per_node: int | None = None
    launcher: str = "local"
    trials: int | None = None
    time_budget_s: float | None = None
    peak_tflops: float | None = None
    trial_timeout_s: float | None = None  # None: from the estimate, with a floor
    heartbeat_s: int = 60  # shared storages: every worker beats this often; stale after 4 beats missed
    dtype: str | None = None  # --dtype; None: the model's on CUDA, fp32 on the CPU (config.trained_dtype)
    grad_dtype: str | None = None  # --grad-dtype; None: the model's where its dtype trains (trained_grad_dtype)
    exhaustive: bool = False  # --exhaustive: no stopping rule (stopping.py) without a budget
    confirm: int = 3  # --confirm: the leading layouts measured again at the end (remeasure.py)

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> "Question":
        """The question as a study stores it; fields an older version did not write take
        their defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in known})

    @classmethod
    def from_study(cls, study: optuna.Study) -> "Question":
        """The question of an Optuna study that `autotune run` created."""
        return cls.from_dict(study.user_attrs["question"])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def model_config(self) -> ModelConfig:
        """The model as the user described it."""
        return model_from_dict(self.model)

    @property
    def trained_model(self) -> ModelConfig:
        """The model in the precision its trials train in (config.trained_dtype)."""
        return as_trained(self.model_config, self.device, self.dtype, self.grad_dtype)

    @property
    def hardware_config(self) -> HardwareConfig:
        return hardware_from_dict(self.hardware)

    @property
    def space_config(self) -> Space:
        return Space(**self.space)

    @property
    def model_name(self) -> str:
        return str(self.model.get("name", "?"))

    @property
    def per_node(self) -> int:
        """GPUs per node (host): the study's, else the hardware's, else all of them on one."""
        return self.gpus_per_node or self.hardware_config.gpus_per_host or self.gpus

    @property
    def scale_up(self) -> int:
        """GPUs per scale-up domain (NVLink / Infinity Fabric), what "inside a node" means in
        the layout rules and the report: the hardware's, which `run` has already fitted to
        --gpus-per-node (HardwareConfig.with_gpus_per_host)."""
        return self.hardware_config.scale_up_gpus

    def trial_spec(self, layout: str) -> TrialSpec:
        """What the study runs for a layout (a full layout string)."""
        return TrialSpec(model=dataclasses.asdict(self.trained_model), layout=layout, steps=self.steps,
                         warmup=self.warmup, seed=self.seed,
                         device=self.device, memory_budget_gb=self.memory_budget_gb, peak_tflops=self.peak_tflops,
                         hardware=self.hardware.get("name"))

    def identity(self) -> dict[str, Any]:
        """What must match for a re-run to resume this study rather than start another."""
        return {"model": self.model, "gpus": self.gpus, "space": self.space["values"], "device": self.device,
                "objective": self.objective, "dtype": self.dtype}


def holds_layout(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether an Optuna trial has its layout: measured, pruned, failed on, running, or
    queued to run again (WAITING: the retry of a trial whose worker died).

    A trial that ended without an outcome of its own gave its layout back, to be
    measured again: its controller was interrupted (reason "interrupted"), or it died
    and was failed by the heartbeat or at resume (state FAIL with no status).
    """
    attrs = trial.user_attrs
    if "layout" not in attrs or attrs.get("reason") == INTERRUPTED:
        return False
    if trial.state.name == "FAIL":
        return "status" in attrs
    return True


def counts_as_launch(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial counts against --trials: every holder of a layout (finished,
    running, or queued again) but those the estimator pruned unlaunched."""
    return holds_layout(trial) and trial.user_attrs.get("reason") != PREDICTED_OOM


# -- re-measured trials (study/remeasure.py runs them) ------------------------------------------
# A re-measured trial's runs are kept in the study's user attribute `remeasured` ({trial number:
# [figures of each complete re-run]}), beside the trial's own, and its figures are the median
# over all its runs (with one re-run: the mean of the two).

REMEASURED_ATTR = "remeasured"
# What a re-run keeps of its trial JSON: the metrics and the steps they come from.
REMEASURED_KEYS = METRICS + ("step_times_s", "duration_s")


def remeasured_figures(record: dict[str, Any]) -> dict[str, Any]:
    return {key: record[key] for key in REMEASURED_KEYS if record.get(key) is not None}


def merged(attrs: dict[str, Any], value: float | None, runs: list[dict[str, Any]],
           objective: str) -> tuple[dict[str, Any], float | None]:
    """A trial's figures over its own run and its re-runs: each metric's median, the
    objective's too; step_times_s all measured steps of every run."""
    if not runs:
        return attrs, value
    every = [attrs] + runs
    out = dict(attrs)
    for key in METRICS:
        values = [run[key] for run in every if run.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    out["step_times_s"] = [s for run in every for s in run.get("step_times_s") or ()]
    return out, out.get(objective, value)


def step_time_spread(attrs: dict[str, Any]) -> tuple[float | None, float | None]:
    """The fastest and the slowest measured step (over every run of a re-measured trial)."""
    steps = attrs.get("step_times_s") or []
    return (min(steps), max(steps)) if steps else (None, None)
