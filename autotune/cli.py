"""`autotune`: the command line (a contract; DESIGN section 4 and the README).

Bad input exits with code 2 and one line naming the field and the rule; with --json
stdout holds exactly one JSON document and everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from rich.console import Console
from rich.table import Table

from autotune.config import hardware_presets, load_hardware, load_model, model_presets
from autotune.errors import UsageError
from autotune.layout import resolve
from autotune.trialspec import TrialSpec

DEFAULT_TRIAL_TIMEOUT_S = 900.0
stderr = Console(stderr=True)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (never the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


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
    add_trial_options(p)
    p.set_defaults(func=cmd_trial)

    p = sub.add_parser("models", help="list the model presets with their sizes")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    p.set_defaults(func=cmd_models)
    return parser


def cmd_trial(args) -> int:
    from autotune.launch import run_trial  # imports psutil; `models` should not need to

    model = load_model(args.model)
    layout = resolve(args.layout, model, args.gpus)
    if args.hardware:
        load_hardware(args.hardware)  # a bad preset or file is a usage error here, not in every rank
    spec = TrialSpec(model=dataclasses.asdict(model), layout=str(layout), steps=args.steps,
                     warmup=args.warmup, seed=args.seed, device=args.device,
                     memory_budget_gb=args.memory_budget_gb, hardware=args.hardware,
                     peak_tflops=args.peak_tflops, trace_dir=os.path.abspath(args.trace) if args.trace else None)
    stderr.print(f"[bold]trial[/] {model.name} on {args.gpus} {args.device} ranks: {layout.short()}")
    result = run_trial(spec, args.gpus, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_trial(result)
    return 0 if result["status"] == "complete" else 1


TRIAL_FIGURES = ("layout", "world_size", "grad_accum", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu",
                 "mfu", "peak_tflops", "peak_tflops_source", "peak_mem_bytes", "memory_budget_bytes",
                 "comm_fraction", "comm_fraction_mean", "exposed_comm_fraction", "exposed_comm_fraction_mean")


def print_trial(result: dict) -> None:
    """The figures of a measured trial (a trial pruned over its memory budget has them too)."""
    console = Console()
    if result["status"] != "complete":
        console.print(f"[bold red]{result['status']}/{result['reason']}[/]: {result.get('error', '')}")
        if result.get("stderr_tail"):
            console.print(result["stderr_tail"], markup=False, highlight=False)
    if "losses" not in result:
        return
    table = Table(show_header=False, box=None)
    for key in TRIAL_FIGURES:
        value = result.get(key)
        if key.endswith("_bytes") and value is not None:
            value = f"{value / 2**30:,.4g} GiB"
        table.add_row(key, f"{value:,.4g}" if isinstance(value, float) else str(value))
    table.add_row("losses", " ".join(f"{x:.4f}" for x in result["losses"]))
    for trace in result.get("trace_files", []):
        table.add_row("trace", trace)
    console.print(table)


def cmd_models(args) -> int:
    rows = []
    for name in model_presets():
        m = load_model(name)
        rows.append({"name": name, "params": m.num_params(), "active_params": m.active_matmul_params(),
                     "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
                     "kv_heads": m.num_kv_heads, "seq_len": m.seq_len, "global_batch": m.global_batch_size,
                     "experts": f"{m.moe.top_k}/{m.moe.num_experts}" if m.moe else "-"})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="model presets (autotune/models)")
    for col in ("name", "params", "active/token", "layers", "hidden", "heads/kv", "seq_len", "batch", "experts"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for r in rows:
        table.add_row(r["name"], human_count(r["params"]), human_count(r["active_params"]), str(r["layers"]),
                      str(r["hidden"]), f"{r['heads']}/{r['kv_heads']}", str(r["seq_len"]),
                      str(r["global_batch"]), r["experts"])
    Console().print(table)
    return 0


def human_count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"autotune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
