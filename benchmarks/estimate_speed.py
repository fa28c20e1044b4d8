"""How fast the estimator prices layouts: every valid layout of llama3-70b on 1024 GPUs
(h100-sxm, the built-in space of `autotune estimate`) must take under 2 seconds.

    .venv/bin/python benchmarks/estimate_speed.py [--model M] [--gpus N] [--repeat R]

Prints one JSON line: the layout count, the best of R timings of estimating them all
(wall and CPU seconds; each starts with the estimator's memo of the model cleared),
the time to enumerate them (layout.py's work, reported apart), the time of what
`autotune estimate` without --layout does (price_every_layout: enumerate, skipping
the layouts whose state alone is over the budget, then a full estimate of the rest),
and the machine's load average, since a busy machine slows all of them.
`--model deepseek-v3 --gpus 256` is the MoE case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from autotune.config import load_hardware, load_model
from autotune.estimate import budget_bytes, estimate, every_layout, price_every_layout
from autotune.estimate import memory as estimate_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    model, hardware = load_model(args.model), load_hardware(args.hardware)
    budget = budget_bytes(hardware, None)

    start = time.perf_counter()
    layouts = every_layout(model, args.gpus, hardware.scale_up_gpus)
    enumerate_s = time.perf_counter() - start

    walls, cpus = [], []
    for _ in range(args.repeat):
        # Each timing starts cold: the estimator memoises per model what layouts share.
        estimate_memory.model_figures.cache_clear()
        wall, cpu = time.perf_counter(), time.process_time()
        estimates = [estimate(model, layout, hardware, budget) for layout in layouts]
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    estimate_memory.model_figures.cache_clear()
    start = time.perf_counter()
    priced, valid, state_over_budget = price_every_layout(model, args.gpus, hardware, budget)
    listing_s = time.perf_counter() - start
    assert valid == len(layouts), (valid, len(layouts))  # the skipped layouts are counted, not lost
    print(json.dumps({
        "model": model.name, "gpus": args.gpus, "hardware": hardware.name, "layouts": len(layouts),
        "predicted_oom": sum(not e.fits for e in estimates),
        "estimate_wall_s": round(min(walls), 3), "estimate_cpu_s": round(min(cpus), 3),
        "us_per_layout": round(min(walls) / len(layouts) * 1e6, 1), "enumerate_wall_s": round(enumerate_s, 3),
        "listing_wall_s": round(listing_s, 3), "listing_priced": len(priced), "listing_state_over_budget":
        state_over_budget,
        "target_s": 2.0, "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
