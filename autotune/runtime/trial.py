"""What every rank of a trial runs: build -> parallelize -> warm up -> profile -> emit JSON.

The measured steps run under torch.profiler (runtime/profiling.py); after them every
rank's figures are gathered once and turned into the trial's metrics (docs/metrics.md).

Started by the launcher (torchrun or srun) as `python -m autotune.runtime.trial --spec JSON`.
Rank 0 prints the result as one line `AUTOTUNE_RESULT {...}` on stdout; a rank that
fails prints `AUTOTUNE_ERROR {...}` on stderr (with whether it was an out-of-memory
error) so that the launcher can tell an OOM from a crash from a Python error.
`run` itself works inside any initialised process group, which is how the tests run
many layouts in one group of processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from autotune.config import GIB, ModelConfig, load_hardware, model_from_dict
from autotune.plan.layout import resolve
from autotune.record import COMPLETE, OOM, PROFILED_METRICS, PRUNED, TrialResult
from autotune.runtime.data import micro_batches
from autotune.runtime.faults import fault_for
from autotune.runtime.mesh import mesh_for
from autotune.runtime.parallel.ep import token_imbalance
from autotune.runtime.parallelize import build_trainer
from autotune.runtime.peak_flops import peak_flops
from autotune.runtime.precision import EIGHT_BIT, compute_dtype, emulated
from autotune.runtime.profiling import StepProfiler, StepTimer
from autotune.runtime.torch_compat import track_cpu_allocations
from autotune.trialspec import ERROR_MARKER, RESULT_MARKER, TrialSpec, die_with_parent

# Figures only the profiler measures, with their per-rank and mean forms, and the
# resident bytes behind the peak.
UNMEASURED_WITHOUT_PROFILER = tuple(f"{name}{suffix}" for name in PROFILED_METRICS
                                    for suffix in ("", "_mean", "_per_rank")) + (
    "resident_mem_bytes_per_rank", "step_peak_mem_bytes_per_rank", "memory_source", "reserved_mem_bytes",
    "reserved_mem_bytes_per_rank", "comm_bytes_per_step_per_rank")


def trial_device(spec: TrialSpec) -> torch.device:
    if spec.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def memory_budget(spec: TrialSpec, device: torch.device) -> int | None:
    """Bytes a rank may hold: --memory-budget-gb (GiB), else the --hardware preset's memory,
    else on CUDA the device's memory; on the CPU none unless given.

    On CUDA the budget is also the allocator's limit (per-process memory fraction), so a
    smaller GPU is emulated by a real OutOfMemoryError where it would have run out."""
    gib = spec.memory_budget_gb
    if gib is None and spec.hardware:
        gib = load_hardware(spec.hardware).memory_gb or None
    budget = int(gib * GIB) if gib else None
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        budget = budget or capacity
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / capacity), device)
    return budget


def run(spec: TrialSpec, keep: dict | None = None) -> TrialResult:
    """Run the trial on the current process group; every rank returns the same summary.

    `keep`, when given, receives the trainer and the meshes, for tests that inspect the
    trained parameters."""
    cfg = model_from_dict(spec.model)
    layout = resolve(spec.layout, cfg, dist.get_world_size())
    device = trial_device(spec)
    budget = memory_budget(spec, device)
    # Before the model exists, so that every tensor of the trial is counted (runtime/memory.py).
    allocator_tracked = device.type == "cpu" and track_cpu_allocations()
    mesh = mesh_for(layout, device.type)
    trainer = build_trainer(cfg, layout, mesh, device, spec)
    if keep is not None:
        keep.update(trainer=trainer, mesh=mesh)

    dist.barrier()  # every rank calibrates at once, as every rank trains at once
    flops, flops_source = peak_flops(spec.peak_tflops, spec.hardware, device, compute_dtype(cfg))
    trace_file = None
    if spec.trace_dir:
        os.makedirs(spec.trace_dir, exist_ok=True)
        trace_file = os.path.join(spec.trace_dir, f"rank{dist.get_rank()}.json")

    grad_accum = layout.grad_accum(cfg)
    dp_rank = mesh["dp"].get_local_rank()
    fault = fault_for(str(layout))
    local_losses = []
    profiler = StepProfiler(device, spec.warmup, spec.steps, trace_file, allocator_tracked) if spec.profile \
        else StepTimer(device, spec.warmup, spec.steps)
    with profiler:
        for step in range(spec.warmup + spec.steps):
            batches = [(x.to(device), y.to(device)) for x, y in micro_batches(
                spec.seed, step, dp_rank, layout.mbs, grad_accum, cfg.seq_len, cfg.vocab_size)]
            if fault:
                fault.before_step(step, dist.get_rank())
            with profiler.step():
                local_losses.append(trainer.step(batches))

    losses = global_losses(torch.stack(local_losses), mesh)
    # Expert parallel: per MoE layer, max / mean tokens received by an ep rank (None at ep=1).
    imbalance = token_imbalance(trainer.model, mesh, spec.warmup)
    # One gather after the measured steps, so measuring adds no communication to them.
    mine = dict(dataclasses.asdict(profiler.figures), comm_fraction=profiler.figures.comm_fraction,
                exposed_comm_fraction=profiler.figures.exposed_comm_fraction, peak_flops=flops)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)

    result: TrialResult = {
        "status": COMPLETE,
        "reason": None,
        "model": cfg.name,
        "layout": str(layout),
        "world_size": layout.world_size,
        "grad_accum": grad_accum,
        "device": device.type,
        "steps": spec.steps,
        "warmup": spec.warmup,
        "losses": losses,
        "dtype": cfg.dtype,
        # fp8 / mxfp8: whether torchao emulated the 8-bit GEMMs (no fp8 tensor cores here).
        "precision_emulated": emulated(device) if cfg.dtype in EIGHT_BIT else None,
        **measurements(cfg, layout.world_size, per_rank, flops_source),
        "memory_budget_bytes": budget,
        "torch_version": torch.__version__,
        "ep_token_imbalance": imbalance,
    }
    if not spec.profile:  # timed only: nothing else was measured
        for key in UNMEASURED_WITHOUT_PROFILER:
            result.pop(key, None)
    elif budget is not None and result["peak_mem_bytes"] > budget:
        rank = result["peak_mem_bytes_per_rank"].index(result["peak_mem_bytes"])
        result.update(status=PRUNED, reason=OOM,
                      error=f"rank {rank}: peak {result['peak_mem_bytes'] / GIB:.3f} GiB is over the memory "
                            f"budget of {budget / GIB:.3f} GiB")
    return result


def measurements(cfg: ModelConfig, world_size: int, per_rank: list[dict], flops_source: str) -> dict:
    """The trial's figures from every rank's (docs/metrics.md):

        step_time_s          = median over measured steps of (max over ranks of the step's wall time)
        tokens_per_s         = global_batch_size * seq_len / step_time_s
        mfu                  = flops_per_token * tokens_per_s / (world_size * peak_flops)
        peak_mem_bytes       = max over ranks of the rank's peak (the least of its steps' peaks)
        reserved_mem_bytes   = CUDA: max over ranks of the allocator's reserved peak (None on the CPU)
        comm_fraction        = max over ranks (and _mean) of comm time / measured time
        exposed_comm_fraction likewise, for communication not overlapped by compute

    peak_flops is the mean over ranks of each rank's figure (they differ only when each
    rank calibrated its own), so world_size * peak_flops is the sum of the ranks' peaks."""
    step_times = [max(steps) for steps in zip(*(r["step_times_s"] for r in per_rank))]
    step_time = statistics.median(step_times)
    tokens_per_s = cfg.global_batch_size * cfg.seq_len / step_time
    flops = statistics.fmean(r["peak_flops"] for r in per_rank)
    figures = {
        "step_times_s": step_times,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / world_size,
        "flops_per_token": cfg.flops_per_token(),
        "peak_tflops": flops / 1e12,
        "peak_tflops_source": flops_source,
        "mfu": cfg.flops_per_token() * tokens_per_s / (world_size * flops),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in per_rank),
        "memory_source": per_rank[0]["memory_source"],
        "reserved_mem_bytes": max((r["reserved_mem_bytes"] for r in per_rank if r["reserved_mem_bytes"] is not None),
                                  default=None),
    }
    for name in ("comm_fraction", "exposed_comm_fraction"):
        values = [r[name] for r in per_rank]
        figures.update({name: max(values), f"{name}_mean": statistics.fmean(values)})
    figures.update({f"{name}_per_rank": [r[name] for r in per_rank] for name in (
        "step_times_s", "peak_mem_bytes", "resident_mem_bytes", "step_peak_mem_bytes", "reserved_mem_bytes",
        "comm_fraction", "exposed_comm_fraction")})
    figures["peak_tflops_per_rank"] = [r["peak_flops"] / 1e12 for r in per_rank]
    figures["comm_bytes_per_step_per_rank"] = [r.get("comm_bytes_per_step") for r in per_rank]
    traces = [r["trace_file"] for r in per_rank if r["trace_file"]]
    if traces:
        figures["trace_files"] = traces
    return figures


def global_losses(local: torch.Tensor, mesh) -> list[float]:
    """Mean loss of the global batch per step, the same on every rank.

    Every rank of a tp group holds the same loss; a pipeline rank holds the token loss
    only if it runs the last stage, and the MoE balance losses of its own stages. So tp
    rank 0 of every pipeline rank contributes local / (dp*cp), the others zero, and one
    all-reduce over the world sums the stages and averages the data-parallel ranks.
    """
    counted = mesh["tp"].get_local_rank() == 0
    share = local.double() / mesh["dp_cp"].size() if counted else torch.zeros_like(local, dtype=torch.float64)
    share = share.cpu()
    if dist.get_backend() == "nccl":
        share = share.to(local.device)
    dist.all_reduce(share)
    return share.cpu().tolist()


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a RuntimeError naming itself."""
    return isinstance(exc, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(exc)


def report_error(exc: BaseException) -> None:
    error = {
        "rank": int(os.environ.get("RANK", 0)),
        "type": type(exc).__name__,
        "oom": is_out_of_memory(exc),
        "message": str(exc).strip().splitlines()[-1][:500] if str(exc).strip() else "",
        "time": time.time(),
    }
    traceback.print_exc(file=sys.stderr)
    print(ERROR_MARKER + json.dumps(error), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of an autotune trial")
    parser.add_argument("--spec", required=True, help="the TrialSpec as JSON")
    args = parser.parse_args(argv)
    die_with_parent()
    spec = TrialSpec.from_json(args.spec)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        dist.init_process_group(backend="nccl" if spec.device == "cuda" else "gloo")
        result = run(spec)
        if dist.get_rank() == 0:
            print(RESULT_MARKER + json.dumps(result), flush=True)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the rank exits 1
        report_error(exc)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: C++ threads of the profiler and of gloo, destroyed
    # at exit, can abort a rank ("terminate called without an active exception") after
    # its work is done, which would turn a measured trial into a crash.
    os._exit(code)
