"""GPU probe of the measurement path (run by gpu_check.sh under torchrun, one rank per GPU).

What the CPU tests cannot show: the names and activity types the profiler gives CUDA
kernels and NCCL's kernels, that profiling.py classifies them as compute and
communication, and that the allocator's peak rises by a known extra tensor. Prints what
it saw and one PASS/FAIL line per check; exits 1 if any check failed.

`--cpu` runs the same checks on the CPU with gloo and smaller tensors (gpu_check.sh
--dry-run): the collective is gloo's, the "kernels" are aten operators, so it shows that
the probe itself runs, not what a GPU records.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from autotune.runtime.profiling import StepProfiler, communication_intervals, compute_intervals, total

MATMUL = 4096
MESSAGE_NUMEL = 32 << 20  # 64 MiB of bf16
EXTRA_BYTES = 256 << 20
CPU_SCALE = 16  # --cpu: matmul side / 16, message and extra tensor / 16^2


def profiled(device: torch.device, step, trace_file: str | None = None) -> StepProfiler:
    """Run `step` 1 + 3 times under StepProfiler, as a trial runs its steps."""
    profiler = StepProfiler(device, warmup=1, steps=3, trace_file=trace_file)
    with profiler:
        for _ in range(4):
            with profiler.step():
                step()
    return profiler


def main() -> int:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    on_cpu = "--cpu" in sys.argv[1:]
    scale = CPU_SCALE if on_cpu else 1
    if on_cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    extra_bytes = EXTRA_BYTES // scale**2
    a = torch.randn(MATMUL // scale, MATMUL // scale, device=device, dtype=torch.bfloat16)
    message = torch.ones(MESSAGE_NUMEL // scale**2, device=device, dtype=torch.bfloat16)
    checks: list[tuple[str, bool, str]] = []

    def compute_and_communicate():
        for _ in range(8):
            a @ a
        dist.all_reduce(message)

    trace = os.path.join(tempfile.mkdtemp(), f"rank{rank}.json")
    both = profiled(device, compute_and_communicate, trace)
    events = both.events
    gpu = collections.Counter((e.kind, e.name[:90]) for e in events if e.device == "cuda")
    nccl_kernels = [e for e in events
                    if e.device == "cuda" and e.kind == "kernel" and e.name.lower().startswith("nccl")]
    if rank == 0 and on_cpu:
        print(f"CPU dry run, torch {torch.__version__}, gloo, world size {world}")
    elif rank == 0:
        nccl = torch.cuda.nccl.version()
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}, world size {world}")
        print("GPU events (activity type, name): count")
        for (kind, name), count in gpu.most_common(25):
            print(f"  {kind:<22} {name}  x{count}")
        cpu_comm = collections.Counter(e.name for e in events
                                       if e.device == "cpu" and e.name.startswith(("nccl", "c10d")))
        print("CPU communication events:", dict(cpu_comm))
    comm_s, compute_s = total(communication_intervals(events)) / 1e9, total(compute_intervals(events)) / 1e9
    f = both.figures
    checks.append(("kernels are classified as compute", compute_s > 0, f"compute {compute_s * 1e3:.2f} ms"))
    if world > 1 and on_cpu:
        checks.append(("gloo's collective classified as communication", f.comm_s > 0,
                       f"comm {f.comm_s * 1e3:.2f} ms, fraction {f.comm_fraction:.3f}"))
    elif world > 1:
        checks.append(("nccl kernels found and classified as communication", bool(nccl_kernels) and f.comm_s > 0,
                       f"{len(nccl_kernels)} kernels, comm {f.comm_s * 1e3:.2f} ms, fraction {f.comm_fraction:.3f}, "
                       f"exposed {f.exposed_comm_fraction:.3f}"))
    else:
        print(f"one rank: {len(nccl_kernels)} nccl kernels seen (NCCL may copy instead), comm {comm_s * 1e3:.2f} ms")
    names = {e.get("name") for e in json.load(open(trace))["traceEvents"]}
    checks.append(("trace written with the step annotation", "autotune.step" in names, trace))

    compute_only = profiled(device, lambda: [a @ a for _ in range(8)])
    checks.append(("no collective, no communication", compute_only.figures.comm_s == 0,
                   f"comm {compute_only.figures.comm_s}"))

    def allocate(extra_bytes):
        def step():
            x = torch.empty((64 << 20) // scale**2, device=device, dtype=torch.uint8)
            extra = torch.empty(extra_bytes, device=device, dtype=torch.uint8)
            del x, extra
        return step
    base = profiled(device, allocate(0))
    extra = profiled(device, allocate(extra_bytes))
    rise = extra.figures.peak_mem_bytes - base.figures.peak_mem_bytes
    checks.append(("allocator peak rises by a known extra tensor (5%)", abs(rise - extra_bytes) <= 0.05 * extra_bytes,
                   f"rise {rise} bytes, expected {extra_bytes}; peak {base.figures.peak_mem_bytes}, "
                   f"resident {base.figures.resident_mem_bytes}"))

    failed = 0
    for name, ok, detail in checks:
        failed += not ok
        print(f"rank {rank} {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
