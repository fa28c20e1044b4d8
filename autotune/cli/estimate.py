"""`autotune estimate`: a layout's predicted memory and speed, or every layout ranked."""

from __future__ import annotations

import dataclasses
import json

from rich.console import Console
from rich.table import Table

from autotune.cli.options import add_dtype_option, positive_float, positive_int
from autotune.config import hardware_presets, human_bytes, load_hardware, load_model
from autotune.errors import UsageError
from autotune.plan.layout import resolve

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


