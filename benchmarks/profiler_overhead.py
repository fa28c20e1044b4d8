"""How much the profiler slows the steps it measures (CPU, gloo).

    python benchmarks/profiler_overhead.py [--model tiny] [--gpus 2] [--layout ""] [--rounds 3] [--steps 5]

First the cost per operator: 10,000 small operators timed alone and under the profiler
as a CPU trial configures it (memory events on), fastest of five. Then a trial: one
trainer per rank, alternating rounds of `steps` steps timed with perf_counter alone and
rounds profiled by StepProfiler; the median step time (max over ranks) of each kind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from autotune.config import load_model
from autotune.plan.layout import resolve
from autotune.runtime.data import micro_batches
from autotune.runtime.mesh import mesh_for
from autotune.runtime.parallelize import build_trainer
from autotune.runtime.profiling import StepProfiler
from autotune.trialspec import TrialSpec


def per_operator_overhead() -> None:
    torch.set_num_threads(1)
    x = torch.randn(64, 64)

    def operators():  # 10,000 operators
        for _ in range(5000):
            (x * 2).add_(1)

    def fastest(profiled: bool) -> float:
        best = float("inf")
        for _ in range(5):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) if profiled \
                    else contextlib.nullcontext():
                start = time.perf_counter()
                operators()
                best = min(best, time.perf_counter() - start)
        return best / 10_000 * 1e6

    plain, profiled = fastest(False), fastest(True)
    print(f"per operator: {plain:.2f} us plain, {profiled:.2f} us profiled (+{profiled - plain:.2f} us)")


def worker(rank: int, args, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.gpus), rank=rank, world_size=args.gpus)
    cfg = load_model(args.model)
    layout = resolve(args.layout, cfg, args.gpus)
    mesh = mesh_for(layout, "cpu")
    spec = TrialSpec(model={}, layout=str(layout))
    trainer = build_trainer(cfg, layout, mesh, torch.device("cpu"), spec)
    grad_accum, dp_rank = layout.grad_accum(cfg), mesh["dp"].get_local_rank()

    def batches(step):
        return micro_batches(0, step, dp_rank, layout.mbs, grad_accum, cfg.seq_len, cfg.vocab_size)

    for step in range(2):  # warm up
        trainer.step(batches(step))
    plain, profiled = [], []
    for _ in range(args.rounds):
        for step in range(args.steps):
            inputs = batches(step)
            start = time.perf_counter()
            trainer.step(inputs)
            plain.append(time.perf_counter() - start)
        with StepProfiler(torch.device("cpu"), 0, args.steps) as profiler:
            for step in range(args.steps):
                inputs = batches(step)
                with profiler.step():
                    trainer.step(inputs)
        profiled += profiler.figures.step_times_s
    times = torch.tensor([plain, profiled], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        plain_s, profiled_s = (statistics.median(row) for row in times.tolist())
        print(f"{args.model} {layout.short()} on {args.gpus} ranks: step {plain_s * 1e3:.1f} ms plain, "
              f"{profiled_s * 1e3:.1f} ms profiled ({profiled_s / plain_s - 1:+.0%})")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layout", default="")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_operator_overhead()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.gpus, start_method="spawn")


if __name__ == "__main__":
    main()
