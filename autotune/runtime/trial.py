"""What every rank of a trial runs: build -> parallelize -> warm up -> measure -> emit JSON.

Started by the launcher (torchrun or srun) as `python -m autotune.runtime.trial --spec JSON`.
Rank 0 prints the result as one line `AUTOTUNE_RESULT {...}` on stdout; a rank that
fails prints `AUTOTUNE_ERROR {...}` on stderr (with whether it was an out-of-memory
error) so that the launcher can tell an OOM from a crash from a Python error.
`run` itself works inside any initialised process group, which is how the tests run
many layouts in one group of processes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from autotune.config import model_from_dict
from autotune.layout import resolve
from autotune.runtime.data import micro_batches
from autotune.runtime.mesh import ParallelDims
from autotune.runtime.parallelize import build_trainer
from autotune.trialspec import ERROR_MARKER, RESULT_MARKER, TrialSpec


def trial_device(spec: TrialSpec) -> torch.device:
    if spec.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(spec: TrialSpec, keep: dict | None = None) -> dict:
    """Run the trial on the current process group; every rank returns the same summary.

    `keep`, when given, receives the trainer and the meshes, for tests that inspect the
    trained parameters."""
    cfg = model_from_dict(spec.model)
    layout = resolve(spec.layout, cfg, dist.get_world_size())
    device = trial_device(spec)
    dims = ParallelDims.from_layout(layout)
    mesh = dims.build_mesh(device.type)
    trainer = build_trainer(cfg, layout, mesh, device, spec)
    if keep is not None:
        keep.update(trainer=trainer, mesh=mesh)

    grad_accum = layout.grad_accum(cfg)
    dp_rank = mesh["dp"].get_local_rank()
    local_losses, step_times = [], []
    for step in range(spec.warmup + spec.steps):
        batches = [(x.to(device), y.to(device)) for x, y in micro_batches(
            spec.seed, step, dp_rank, layout.mbs, grad_accum, cfg.seq_len, cfg.vocab_size)]
        synchronize(device)
        start = time.perf_counter()
        local_losses.append(trainer.step(batches))
        synchronize(device)
        step_times.append(time.perf_counter() - start)

    losses = global_losses(torch.stack(local_losses), mesh, trainer.holds_loss)
    # A step ends when its slowest rank ends: the step time is the max over ranks.
    times = torch.tensor(step_times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    measured = times[spec.warmup:].tolist()
    step_time = statistics.median(measured)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    return {
        "status": "complete",
        "reason": None,
        "model": cfg.name,
        "layout": str(layout),
        "world_size": layout.world_size,
        "grad_accum": grad_accum,
        "device": device.type,
        "steps": spec.steps,
        "warmup": spec.warmup,
        "losses": losses,
        "step_times_s": measured,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "tokens_per_s_per_gpu": tokens_per_step / step_time / layout.world_size,
        "torch_version": torch.__version__,
    }


def global_losses(local: torch.Tensor, mesh, holds_loss: bool) -> list[float]:
    """Mean loss of the global batch per step, the same on every rank.

    Every rank of a tp group holds the same loss, and only the ranks that run the last
    pipeline stage (`holds_loss`: the last pipeline rank, or the first under a V
    schedule) hold one at all; so tp rank 0 of those contributes local / (dp*cp), the
    others zero, and one all-reduce over the world gives the mean over data-parallel ranks.
    """
    counted = holds_loss and mesh["tp"].get_local_rank() == 0
    share = local.double() / mesh["dp_cp"].size() if counted else torch.zeros_like(local, dtype=torch.float64)
    share = share.cpu()
    if dist.get_backend() == "nccl":
        share = share.to(local.device)
    dist.all_reduce(share)
    return share.cpu().tolist()


def die_with_parent() -> None:
    """Ask Linux to kill this rank if its launcher dies, so no rank outlives its trial."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def report_error(exc: BaseException) -> None:
    error = {
        "rank": int(os.environ.get("RANK", 0)),
        "type": type(exc).__name__,
        "oom": isinstance(exc, torch.OutOfMemoryError),
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
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the rank exits 1
        report_error(exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
