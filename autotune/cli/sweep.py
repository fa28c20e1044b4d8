"""The sweep's commands: `autotune run` (search a space with measured trials), `autotune worker`
(join a shared study), `autotune report` (write the reports again from a study's storage)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from autotune.cli.options import (
    add_launcher_options,
    add_trial_options,
    default_hardware,
    fraction,
    non_negative_int,
    positive_float,
    positive_int,
)
from autotune.config import as_trained, load_hardware, load_model
from autotune.config.trainable import check_trainable
from autotune.errors import UsageError
from autotune.plan.space import load_space
from autotune.record import COMPLETE, DEFAULT_MAX_COMM_FRACTION, OBJECTIVES, SAMPLER_NAMES


def add_run_parser(sub) -> None:
    """`autotune run --model M --gpus N [--space S] ...`: the sweep."""
    p = sub.add_parser("run", help="search the layouts of a space with real, measured trials")
    p.add_argument("--model", required=True, help="preset name, YAML file or Hugging Face config.json")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs (processes) per trial")
    p.add_argument("--space", default="default",
                   help="search space: a YAML file or a name in search_spaces/ (default: default)")
    p.add_argument("--trials", type=positive_int, default=None,
                   help="launch at most this many trials (default: until more trials are not expected to pay: "
                        "the stopping rule, README)")
    p.add_argument("--time-budget", type=positive_float, default=None, metavar="S",
                   help="start no trial after S seconds (default: none)")
    p.add_argument("--exhaustive", action="store_true",
                   help="with no --trials or --time-budget, measure every layout instead of stopping by the rule")
    p.add_argument("--confirm", type=non_negative_int, default=3, metavar="K",
                   help="at the end, measure the K best layouts again in fresh processes; their figures become "
                        "the median of their runs (default 3; 0: none)")
    p.add_argument("--out", default=None, help="results folder (default results/<model>-<gpus>gpus)")
    p.add_argument("--storage", default=None,
                   help="where the study lives: sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB or "
                        "journal:PATH, shared with `autotune worker` (default: SQLite in --out)")
    p.add_argument("--study-name", default=None, help="default <model>-<gpus>gpus")
    p.add_argument("--heartbeat", type=positive_int, default=60, metavar="S",
                   help="shared storage: running trials beat every S seconds; a trial silent for 4 x S is "
                        "retried by another worker (default 60; stored with the study)")
    p.add_argument("--objective", choices=OBJECTIVES, default="tokens_per_s", help="default tokens_per_s")
    p.add_argument("--max-comm-fraction", type=fraction, default=None,
                   help="prune a layout whose exposed communication exceeds this share of the step "
                        f"(default: the space's option, else {DEFAULT_MAX_COMM_FRACTION:.2f})")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="peak TFLOP/s per device for MFU (default: hardware preset, or measured on CPU)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (host): a trial of more spans gpus / G nodes; TP stays inside "
                        "the scale-up domain, which is the host but on rack-scale NVLink (NVL72: 72) "
                        "(default: the hardware's)")
    add_launcher_options(p)
    p.add_argument("--trial-timeout", type=positive_float, default=None, metavar="S",
                   help="wall-clock limit of each trial (default: 5x its predicted run time, at least "
                        "180 s on CPU and 600 s on CUDA)")
    p.add_argument("--sampler", choices=SAMPLER_NAMES, default="model", help="default model (estimator-guided)")
    add_trial_options(p)
    p.set_defaults(func=cmd_run, steps=None, warmup=None)


def add_worker_parser(sub) -> None:
    """`autotune worker --storage URL --study-name NAME`: another machine's trials of a shared study."""
    p = sub.add_parser("worker", help="join a study on a shared storage and run its trials here")
    p.add_argument("--storage", required=True, help="the study's storage URL (as given to autotune run)")
    p.add_argument("--study-name", required=True, help="the study to join")
    p.add_argument("--out", default=None, help="folder for this worker's trial logs and reports "
                                               "(default results/<study-name>)")
    add_launcher_options(p, default=None)
    p.set_defaults(func=cmd_worker)


def add_report_parser(sub) -> None:
    """`autotune report DIR`: trials.csv, report.html and best/ again, running nothing."""
    p = sub.add_parser("report", help="write trials.csv, report.html and best/ again from a study's storage")
    p.add_argument("dir", metavar="DIR", help="results folder (holds study.db unless --storage is given)")
    p.add_argument("--storage", default=None, help="Optuna storage URL of a shared study (default: DIR/study.db)")
    p.add_argument("--study-name", default=None, help="the study to report (default: the storage's only one)")
    p.set_defaults(func=cmd_report)


def cmd_run(args) -> int:
    from autotune.launch.launchers import Launcher
    from autotune.record import Question
    from autotune.study.controller import run_sweep  # optuna and friends: only for commands that need them

    model = load_model(args.model)
    # --grad-dtype against the dtype, and the precision against the model, before any study.
    check_trainable(as_trained(model, args.device, args.dtype, args.grad_dtype))
    space = load_space(args.space)
    hardware = load_hardware(args.hardware or default_hardware(args.device))
    if args.gpus_per_node is not None:
        if args.gpus_per_node > args.gpus:
            raise UsageError(f"--gpus-per-node: must be <= --gpus ({args.gpus}), got {args.gpus_per_node}")
        if args.gpus % args.gpus_per_node:
            raise UsageError(f"--gpus-per-node: must divide --gpus ({args.gpus}): a trial uses whole nodes, "
                             f"got {args.gpus_per_node}")
    if args.gpus_per_node:  # hosts of this size; a host-sized scale-up domain follows (HardwareConfig)
        hardware = hardware.with_gpus_per_host(args.gpus_per_node)
    options = space.options
    question = Question(
        model=dataclasses.asdict(model), gpus=args.gpus, space=dataclasses.asdict(space),
        hardware=dataclasses.asdict(hardware), objective=args.objective, sampler=args.sampler,
        max_comm_fraction=args.max_comm_fraction if args.max_comm_fraction is not None
        else options.get("max_comm_fraction", DEFAULT_MAX_COMM_FRACTION),
        memory_budget_gb=args.memory_budget_gb or (hardware.memory_gb or None),
        device=args.device, steps=args.steps or options.get("steps", 5),
        warmup=args.warmup if args.warmup is not None else options.get("warmup", 2), seed=args.seed,
        gpus_per_node=args.gpus_per_node or hardware.gpus_per_host, launcher=args.launcher,
        trials=args.trials, time_budget_s=args.time_budget, peak_tflops=args.peak_tflops,
        trial_timeout_s=args.trial_timeout, heartbeat_s=args.heartbeat, dtype=args.dtype, grad_dtype=args.grad_dtype,
        exhaustive=args.exhaustive, confirm=args.confirm)
    Launcher(question.launcher, question.gpus_per_node, args.hosts).check(args.gpus)  # before the study exists
    out = Path(args.out or f"results/{model.name}-{args.gpus}gpus")
    return run_sweep(question, out, storage=args.storage, study_name=args.study_name, hosts=args.hosts)


def cmd_worker(args) -> int:
    from autotune.study.controller import run_worker

    return run_worker(args.storage, args.study_name, out=Path(args.out) if args.out else None,
                      launcher=args.launcher, hosts=args.hosts)


def cmd_report(args) -> int:
    """Reads the study and writes files: runs nothing, so it works during or after a sweep."""
    from autotune.report import write_reports
    from autotune.study.storage import load_study

    out = Path(args.dir)
    if args.storage is None and not out.is_dir():
        raise UsageError(f"DIR {out}: no such folder")
    study = load_study(out, args.storage, args.study_name)
    frame = write_reports(study, out)
    written = ["trials.csv", "report.html"] + (["best/"] if (frame["status"] == COMPLETE).any() else [])
    print(f"{study.study_name}: {len(frame)} trials -> " + ", ".join(str(out / name) for name in written),
          file=sys.stderr)
    return 0


