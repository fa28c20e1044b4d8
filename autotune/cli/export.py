"""`autotune export`: the best/ files for a layout the user already knows, without a sweep.

The same code writes best/ at the end of a sweep (report/best.py), so a layout exported
here reads exactly as a recommended one would; only the measured figures are missing.
The layout is checked by the same rules as `autotune trial` (layout.resolve), so a
layout that cannot run is a usage error naming the key and the rule.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from autotune.cli.options import positive_int
from autotune.config import hardware_presets, load_hardware, load_model
from autotune.plan.layout import resolve
from autotune.record import Question

DEFAULT_HARDWARE = "h100-sxm"


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write best/ (torchrun, Megatron-LM, torchtitan, DeepSpeed) for one layout")
    p.add_argument("--model", required=True, help="preset name, YAML file or Hugging Face config.json")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs the layout uses")
    p.add_argument("--layout", required=True, help='e.g. "tp=2,pp=2,mbs=1"; omitted keys take defaults')
    p.add_argument("--hardware", default=DEFAULT_HARDWARE,
                   help=f"hardware preset or YAML ({', '.join(hardware_presets())}): its GPUs per node keep TP "
                        f"inside a node and size torchrun's nodes (default {DEFAULT_HARDWARE})")
    p.add_argument("--out", default="best", help="folder to write (default ./best)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from autotune.report.best import write_best  # the report's imports only for this command

    model = load_model(args.model)
    hardware = load_hardware(args.hardware)
    layout = resolve(args.layout, model, args.gpus, hardware.scale_up_gpus)  # TP inside the scale-up domain
    device = "cpu" if hardware.name == "cpu" else "cuda"
    question = Question(model=dataclasses.asdict(model), gpus=args.gpus, space={},
                        hardware=dataclasses.asdict(hardware), device=device,
                        memory_budget_gb=hardware.memory_gb or None, gpus_per_node=hardware.gpus_per_host)
    out = Path(args.out)
    written = write_best(out, question, {"layout": str(layout)})
    print(f"{model.name} on {args.gpus} GPUs, {layout.short()} -> " + ", ".join(str(p) for p in written),
          file=sys.stderr)
    return 0
