"""`autotune trial`: run one layout and print its measurements."""

from __future__ import annotations

import dataclasses
import json
import os

from rich.console import Console
from rich.table import Table

from autotune.cli.options import (
    add_launcher_options,
    add_trial_options,
    positive_float,
    positive_int,
    stderr,
)
from autotune.config import GIB, as_trained, load_hardware, load_model
from autotune.config.trainable import check_trainable
from autotune.plan.layout import resolve
from autotune.record import COMPLETE, METRICS
from autotune.trialspec import TrialSpec

DEFAULT_TRIAL_TIMEOUT_S = 900.0


def add_trial_parser(sub) -> None:
    """`autotune trial --model M --gpus N --layout L [--json] ...`"""
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


def cmd_trial(args) -> int:
    from autotune.launch.launchers import Launcher, run_trial

    model = load_model(args.model)
    # Tensor parallel stays inside the scale-up domain: the hardware's (NVL72: 72, whatever the
    # host), else the hosts of --gpus-per-node.
    scale_up = args.gpus_per_node
    if args.hardware:  # a bad preset or file is a usage error here, not in every rank
        hardware = load_hardware(args.hardware)
        scale_up = (hardware.with_gpus_per_host(args.gpus_per_node) if args.gpus_per_node else hardware).scale_up_gpus
    layout = resolve(args.layout, model, args.gpus, scale_up)
    trained = as_trained(model, args.device, args.dtype, args.grad_dtype)
    check_trainable(trained, layout.pp)
    launcher = Launcher(args.launcher, args.gpus_per_node, args.hosts)
    launcher.check(args.gpus)
    spec = TrialSpec(model=dataclasses.asdict(trained),
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


