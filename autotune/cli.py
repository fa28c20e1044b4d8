"""`autotune`: the command line (a contract: README, "Command line").

Bad input exits with code 2 and one line naming the field and the rule; with --json
stdout holds exactly one JSON document and everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autotune.config import (
    DTYPES,
    GIB,
    GRAD_DTYPES,
    as_trained,
    hardware_for_device_name,
    hardware_presets,
    human_bytes,
    load_hardware,
    load_model,
    parse_dtype,
)
from autotune.errors import UsageError
from autotune.export.command import add_export_parser
from autotune.launch import LAUNCHERS
from autotune.layout import resolve
from autotune.models_listing import cmd_models
from autotune.record import COMPLETE, DEFAULT_MAX_COMM_FRACTION, METRICS, OBJECTIVES, SAMPLER_NAMES
from autotune.space import load_space
from autotune.trainable import check_trainable
from autotune.trialspec import TrialSpec

DEFAULT_TRIAL_TIMEOUT_S = 900.0
stderr = Console(stderr=True)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (never the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def dtype_option(text: str) -> str:
    """--dtype as people write it (bfloat16, float32, fp8_e4m3, ...), in its canonical name."""
    try:
        return parse_dtype(text, "--dtype")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--dtype: ")) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def host_list(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(","))
    if not all(hosts):
        raise argparse.ArgumentTypeError(f"must be host names separated by commas, got {text!r}")
    return hosts


def add_launcher_options(p: argparse.ArgumentParser, default: str | None = "local") -> None:
    """How a trial's processes start; README, "Sweeps on several machines"."""
    p.add_argument("--launcher", choices=LAUNCHERS, default=default,
                   help="local: every rank here (torchrun --standalone); torchrun: one agent per node of --hosts, "
                        "c10d rendezvous; slurm: one srun step per trial in the current allocation"
                        + (f" (default {default})" if default else " (default: the study's)"))
    p.add_argument("--hosts", type=host_list, default=(), metavar="H1,H2,...",
                   help="the nodes of a multi-node trial, first one hosting the rendezvous: localhost or this "
                        "machine's name run here, others over ssh (slurm default: the allocation's nodes)")


def add_trial_options(p: argparse.ArgumentParser) -> None:
    """Options shared by everything that runs trials."""
    p.add_argument("--steps", type=positive_int, default=5, help="measured optimizer steps (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="unmeasured steps first (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where ranks run (default cpu)")
    p.add_argument("--memory-budget-gb", type=positive_float, default=None,
                   help="a measured peak above this is an OOM (default: the device's memory; none on CPU)")
    p.add_argument("--hardware", default=None,
                   help=f"hardware preset or YAML ({', '.join(hardware_presets())}); default from the device")
    add_dtype_option(p)


def add_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, type=dtype_option, metavar="|".join(DTYPES),
                   help="train in this precision instead of the model's (default: the model's on CUDA, fp32 on the "
                        "CPU; --dtype bf16 on the CPU runs the GPU's mixed-precision plan)")
    p.add_argument("--grad-dtype", default=None, choices=GRAD_DTYPES, metavar="|".join(GRAD_DTYPES),
                   help="accumulate, reduce and keep gradients in this precision: fp32, or the compute dtype, "
                        "as Megatron-LM without grad_reduce_in_fp32 (default: the model's grad_dtype, fp32)")


def build_parser() -> Parser:
    parser = Parser(prog="autotune", description="Profiler-driven autotuner for the parallel layout of "
                                                  "LLM training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("trial", help="run one layout and print its measurements")
    p.add_argument("--model", required=True, help="preset name, YAML file or Hugging Face config.json")
    p.add_argument("--gpus", type=positive_int, required=True, help="processes (GPUs) in the trial")
    p.add_argument("--layout", default="", help='e.g. "tp=2,pp=2,mbs=1"; omitted keys take defaults')
    p.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TRIAL_TIMEOUT_S,
                   help=f"wall-clock limit in seconds (default {DEFAULT_TRIAL_TIMEOUT_S:.0f})")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="peak TFLOP/s of one device for MFU (default: hardware preset, else a calibration GEMM)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="write each rank's profiler trace (Chrome/Perfetto JSON) to DIR/rank<N>.json")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node: a trial of more spans gpus / G nodes (with --launcher torchrun or slurm)")
    add_launcher_options(p)
    p.add_argument("--max-grad-norm", type=positive_float, default=None, metavar="N",
                   help="clip gradients to this global L2 norm, across every shard and stage (default: off)")
    add_trial_options(p)
    p.set_defaults(func=cmd_trial)

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

    p = sub.add_parser("worker", help="join a study on a shared storage and run its trials here")
    p.add_argument("--storage", required=True, help="the study's storage URL (as given to autotune run)")
    p.add_argument("--study-name", required=True, help="the study to join")
    p.add_argument("--out", default=None, help="folder for this worker's trial logs and reports "
                                               "(default results/<study-name>)")
    add_launcher_options(p, default=None)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("models", help="describe model files (YAML or config.json), or every preset")
    p.add_argument("paths", nargs="*", metavar="PATH", help="model files or preset names (default: every preset)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("report", help="write trials.csv, report.html and best/ again from a study's storage")
    p.add_argument("dir", metavar="DIR", help="results folder (holds study.db unless --storage is given)")
    p.add_argument("--storage", default=None, help="Optuna storage URL of a shared study (default: DIR/study.db)")
    p.add_argument("--study-name", default=None, help="the study to report (default: the storage's only one)")
    p.set_defaults(func=cmd_report)
    add_estimate_parser(sub)
    add_export_parser(sub, positive_int)
    return parser


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value}")
    return value


def default_hardware(device: str) -> str:
    """cpu on the CPU; on CUDA the preset matching nvidia-smi's device name, else h100-sxm."""
    if device == "cpu":
        return "cpu"
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        name = ""
    preset = hardware_for_device_name(name)
    if preset is None:
        stderr.print(f"no hardware preset for {name or 'this GPU'!r}: assuming h100-sxm (use --hardware)")
        return "h100-sxm"
    return preset.name


def cmd_run(args) -> int:
    from autotune.launch import Launcher
    from autotune.record import Question
    from autotune.study import run_sweep  # optuna and friends: only for commands that need them

    model = load_model(args.model)
    check_trainable(model)
    as_trained(model, args.device, args.dtype, args.grad_dtype)  # --grad-dtype against the dtype, before any study
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
    from autotune.study import run_worker

    return run_worker(args.storage, args.study_name, out=Path(args.out) if args.out else None,
                      launcher=args.launcher, hosts=args.hosts)


def cmd_trial(args) -> int:
    from autotune.launch import Launcher, run_trial

    model = load_model(args.model)
    # Tensor parallel stays inside the scale-up domain: the hardware's (NVL72: 72, whatever the
    # host), else the hosts of --gpus-per-node.
    scale_up = args.gpus_per_node
    if args.hardware:  # a bad preset or file is a usage error here, not in every rank
        hardware = load_hardware(args.hardware)
        scale_up = (hardware.with_gpus_per_host(args.gpus_per_node) if args.gpus_per_node else hardware).scale_up_gpus
    layout = resolve(args.layout, model, args.gpus, scale_up)
    check_trainable(model)
    launcher = Launcher(args.launcher, args.gpus_per_node, args.hosts)
    launcher.check(args.gpus)
    spec = TrialSpec(model=dataclasses.asdict(as_trained(model, args.device, args.dtype, args.grad_dtype)),
                     layout=str(layout),
                     steps=args.steps,
                     warmup=args.warmup, seed=args.seed, device=args.device,
                     memory_budget_gb=args.memory_budget_gb, hardware=args.hardware,
                     peak_tflops=args.peak_tflops, trace_dir=os.path.abspath(args.trace) if args.trace else None,
                     max_grad_norm=args.max_grad_norm)
    stderr.print(f"[bold]trial[/] {model.name} on {args.gpus} {args.device} ranks: {layout.short()}")
    result = run_trial(spec, args.gpus, timeout_s=args.timeout, launcher=launcher)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_trial(result)
    return 0 if result["status"] == COMPLETE else 1


# What `autotune trial` prints: the metrics with what they are measured against.
TRIAL_FIGURES = ("layout", "world_size", "grad_accum") + METRICS + (
    "peak_tflops", "peak_tflops_source", "memory_budget_bytes", "comm_fraction_mean", "exposed_comm_fraction_mean")


def print_trial(result: dict) -> None:
    """The figures of a measured trial (a trial pruned over its memory budget has them too)."""
    console = Console()
    if result["status"] != COMPLETE:
        console.print(f"[bold red]{result['status']}/{result['reason']}[/]: {result.get('error', '')}")
        if result.get("stderr_tail"):
            console.print(result["stderr_tail"], markup=False, highlight=False)
    if "losses" not in result:
        return
    table = Table(show_header=False, box=None)
    for key in TRIAL_FIGURES:
        value = result.get(key)
        if key.endswith("_bytes") and value is not None:
            value = f"{value / GIB:,.4g} GiB"
        table.add_row(key, f"{value:,.4g}" if isinstance(value, float) else str(value))
    table.add_row("losses", " ".join(f"{x:.4f}" for x in result["losses"]))
    for trace in result.get("trace_files", []):
        table.add_row("trace", trace)
    console.print(table)


def cmd_report(args) -> int:
    """Reads the study and writes files: runs nothing, so it works during or after a sweep."""
    from autotune.report import write_reports
    from autotune.storage import load_study

    out = Path(args.dir)
    if args.storage is None and not out.is_dir():
        raise UsageError(f"DIR {out}: no such folder")
    study = load_study(out, args.storage, args.study_name)
    frame = write_reports(study, out)
    written = ["trials.csv", "report.html"] + (["best/"] if (frame["status"] == COMPLETE).any() else [])
    print(f"{study.study_name}: {len(frame)} trials -> " + ", ".join(str(out / name) for name in written),
          file=sys.stderr)
    return 0


# -- autotune estimate ------------------------------------------------------------------------

DEFAULT_ESTIMATE_HARDWARE = "h100-sxm"


def add_estimate_parser(sub) -> None:
    p = sub.add_parser("estimate", help="predict memory and speed of one layout, or rank every layout")
    p.add_argument("--model", required=True, help="preset name, YAML file or Hugging Face config.json")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs the layouts use")
    p.add_argument("--layout", default=None,
                   help='e.g. "tp=2,pp=2,mbs=1": its full breakdown; omitted: every valid layout, ranked')
    p.add_argument("--hardware", default=DEFAULT_ESTIMATE_HARDWARE,
                   help=f"hardware preset or YAML ({', '.join(hardware_presets())}); "
                        f"default {DEFAULT_ESTIMATE_HARDWARE}")
    p.add_argument("--memory-budget-gb", type=positive_float, default=None,
                   help="GiB per GPU a layout may use (default: the hardware's memory)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the runtime's precision: cpu (fp32) or cuda (bf16 on fp32 masters); "
                        "default cpu for the cpu hardware preset, else cuda")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="peak TFLOP/s per device, overriding the hardware's (the cpu preset has none)")
    p.add_argument("--top", type=positive_int, default=25, help="rows of the ranked table (default 25)")
    add_dtype_option(p)
    p.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(args) -> int:
    from autotune.estimate import budget_bytes, estimate, price_every_layout, rank_estimates

    model = load_model(args.model)
    hardware = load_hardware(args.hardware)
    if args.peak_tflops is not None:  # the bf16 peak; the other precisions keep their ratio to it
        ratio = args.peak_tflops / hardware.peak_tflops if hardware.peak_tflops else None
        hardware = dataclasses.replace(hardware, peak_tflops=args.peak_tflops, dense_tflops={
            k: v * ratio for k, v in hardware.dense_tflops.items()} if ratio else {})
    device = args.device or ("cpu" if hardware.name == "cpu" else "cuda")
    budget = budget_bytes(hardware, args.memory_budget_gb)
    if args.layout is not None:
        layout = resolve(args.layout, model, args.gpus, hardware.scale_up_gpus)
        result = estimate(model, layout, hardware, budget, device=device, dtype=args.dtype,
                          grad_dtype=args.grad_dtype)
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
        else:
            print_estimate(result, model.name, hardware.name)
        return 0
    priced, valid_layouts, state_over_budget = price_every_layout(model, args.gpus, hardware, budget, device=device,
                                                                  dtype=args.dtype, grad_dtype=args.grad_dtype)
    if not valid_layouts:
        raise UsageError(f"gpus: no valid layout of {model.name} on {args.gpus} GPUs "
                         f"({hardware.scale_up_gpus} per scale-up domain)")
    ranked = rank_estimates(priced)
    if args.json:
        print(json.dumps({"model": model.name, "gpus": args.gpus, "hardware": hardware.name, "device": device,
                          "memory_budget_bytes": budget, "valid_layouts": valid_layouts,
                          "state_over_budget": state_over_budget, "layouts": [e.to_dict() for e in ranked]}))
    else:
        print_estimates(ranked, model.name, args.gpus, hardware.name, args.top, state_over_budget, budget)
    return 0


def print_estimate(e, model_name: str, hardware_name: str) -> None:
    console = Console()
    budget = "no budget" if e.memory_budget_bytes is None else f"budget {human_bytes(e.memory_budget_bytes)}"
    verdict = "[green]fits[/]" if e.fits else "[bold red]predicted OOM[/]"
    console.print(f"[bold]{model_name}[/] on {e.layout.world_size} x {hardware_name} ({e.device}): "
                  f"{e.layout.short()}  grad_accum {e.grad_accum}")
    memory = Table(title=f"memory of pipeline rank {e.worst_pp_rank} at its peak ({e.peak_phase})")
    memory.add_column("term")
    memory.add_column("bytes", justify="right")
    memory.add_column("share", justify="right")
    for term, value in e.memory.items():
        memory.add_row(term, human_bytes(value), f"{value / e.peak_mem_bytes:.1%}")
    memory.add_row("[bold]peak[/]", f"[bold]{human_bytes(e.peak_mem_bytes)}[/]", f"{verdict} ({budget})")
    console.print(memory)
    if e.step_time_s != e.step_time_s:  # NaN: no peak FLOP/s known
        console.print("time: unknown (the hardware has no peak_tflops; give --peak-tflops)")
        return
    time = Table(title="time per optimizer step", show_header=False)
    for key, value in (("step time", f"{e.step_time_s:,.4g} s"), ("tokens/s", f"{e.tokens_per_s:,.0f}"),
                       ("tokens/s per GPU", f"{e.tokens_per_s_per_gpu:,.1f}"), ("MFU", f"{e.mfu:.1%}"),
                       ("busy (compute + TP/CP/EP comm)", f"{e.compute_s:,.4g} s"),
                       ("pipeline bubble", f"{e.bubble_s:,.4g} s ({e.bubble_fraction:.1%})"),
                       ("exposed communication", f"{e.comm_fraction:.1%} of the step"),
                       ("all communication", f"{e.total_comm_fraction:.1%} of the step")):
        time.add_row(key, value)
    for dim, total in e.comm_s.items():
        time.add_row(f"  {dim}", f"{total:,.4g} s, exposed {e.exposed_comm_s.get(dim, 0.0):,.4g} s")
    console.print(time)


def print_estimates(ranked: list, model_name: str, gpus: int, hardware_name: str, top: int,
                    state_over_budget: int = 0, budget: float | None = None) -> None:
    console = Console()
    oom = sum(not e.fits for e in ranked) + state_over_budget
    unpriced = f", {state_over_budget:,} of them by their state alone (not priced further)" if state_over_budget else ""
    table = Table(title=f"{len(ranked) + state_over_budget:,} valid layouts of {model_name} on {gpus} x "
                        f"{hardware_name}, {oom:,} predicted OOM "
                        f"({'no budget' if budget is None else human_bytes(budget)}{unpriced}); "
                        f"the {min(top, len(ranked))} best by predicted tokens/s, fitting ones first")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("layout", overflow="fold")
    for col in ("peak", "fits", "tokens/s", "MFU", "bubble", "comm", "step s"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, e in enumerate(ranked[:top], 1):
        known = e.step_time_s == e.step_time_s  # NaN without a peak FLOP/s
        table.add_row(str(i), e.layout.short(), human_bytes(e.peak_mem_bytes), "yes" if e.fits else "[red]OOM[/]",
                      f"{e.tokens_per_s:,.0f}" if known else "-", f"{e.mfu:.1%}" if known else "-",
                      f"{e.bubble_fraction:.1%}" if known else "-", f"{e.comm_fraction:.1%}" if known else "-",
                      f"{e.step_time_s:,.3g}" if known else "-")
    console.print(table)
    console.print("peak: memory of the worst rank; comm: exposed communication / step time")


# The exit status when the reader of our output left: 1, as rich's console exits when it
# meets a closed pipe, so a table and a JSON document end the same way.
CLOSED_PIPE_STATUS = 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"autotune {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`autotune estimate ... | head`): stop quietly, as Unix tools do.
        # stdout goes to /dev/null so that Python's flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
