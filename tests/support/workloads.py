"""Synthetic steps whose communication and memory are known by construction, profiled by
`autotune.runtime.profiling.StepProfiler` in a group of real gloo processes.

Each workload is `make(rank, **options) -> step`: it sets up the rank's persistent state
and returns the function one step runs. `profile_workloads` spawns the group once and
profiles every (workload, options) in it, returning each rank's figures. A barrier
before each step lines the ranks up, so that what a rank waits for inside a step is
what that step's workload makes it wait for, not another rank's lag from an earlier step
(the machine running the tests may be busy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MATMUL_SIZE = 192


def matmuls(a: torch.Tensor, count: int) -> None:
    for _ in range(count):
        a @ a


def compute_only(rank: int, count: int = 4):
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    return lambda: matmuls(a, count)


def communicate_only(rank: int, numel: int):
    buffer = torch.ones(numel)
    return lambda: dist.all_reduce(buffer)


def compute_then_communicate(rank: int, numel: int, count: int = 4):
    a, buffer = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.ones(numel)

    def step():
        matmuls(a, count)
        dist.all_reduce(buffer)
    return step


def late_rank(rank: int, sleep_s: float, late: int = 1, count: int = 4):
    """Every rank computes the same, then all-reduces; rank `late` sleeps first."""
    a, buffer = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.ones(256)

    def step():
        matmuls(a, count)
        if rank == late:
            time.sleep(sleep_s)
        dist.all_reduce(buffer)
    return step


def overlapped(rank: int, numel: int, n: int, late_s: float, late: int = 1):
    """An asynchronous all-reduce behind one n x n matmul; rank `late` sleeps before it, so
    the others' collectives wait for it while they compute. One long operator: its
    interval has no gaps in which a busy machine could run the collective uncovered."""
    a, buffer = torch.randn(n, n), torch.ones(numel)

    def step():
        if rank == late:
            time.sleep(late_s)
        work = dist.all_reduce(buffer, async_op=True)
        a @ a
        work.wait()
    return step


def sequential(rank: int, numel: int, n: int, late_s: float, late: int = 1):
    """The same work as `overlapped`, the all-reduce after the matmul."""
    a, buffer = torch.randn(n, n), torch.ones(numel)

    def step():
        if rank == late:
            time.sleep(late_s)
        a @ a
        dist.all_reduce(buffer)
    return step


def every_collective(rank: int):
    """One of each collective the runtime uses, and a point-to-point exchange."""
    x, peer = torch.ones(1024), 1 - rank

    def step():
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(2 * x.numel()), x)
        dist.reduce_scatter_tensor(torch.empty(x.numel() // 2), x)
        dist.all_to_all_single(torch.empty_like(x), x)
        dist.broadcast(x, 0)
        dist.barrier()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                            dist.P2POp(dist.irecv, torch.empty_like(x), peer)]):
            work.wait()
    return step


def late_sender(rank: int, sleep_s: float):
    """Rank 1 sleeps, then sends to rank 0, which is already waiting to receive."""
    x = torch.ones(1024)

    def step():
        if rank == 1:
            time.sleep(sleep_s)
            dist.send(x, 0)
        else:
            dist.recv(x, 1)
    return step


def allocate(rank: int, resident_bytes: int = 0, extra_bytes: int = 0):
    """Holds `resident_bytes` across steps; each step's peak is two 4 MiB temporaries plus
    an `extra_bytes` tensor alive at the same time."""
    resident = torch.ones(resident_bytes, dtype=torch.uint8)

    def step():
        x = torch.ones(1 << 20)
        y = x * 2
        extra = torch.ones(extra_bytes, dtype=torch.uint8)
        del x, y, extra
    step.resident = resident  # kept alive by the step function, as weights are by a model
    return step


def freed_elsewhere(rank: int):
    """Each step allocates x, hands it to a thread of its own that drops it (the last
    reference: the free happens on that thread, as gloo's worker frees a buffer of a
    finished collective), then allocates y as large: the step's peak is one of them."""
    def step():
        held = [torch.ones(1 << 20)]
        worker = threading.Thread(target=held.clear)
        worker.start()
        worker.join()
        y = torch.ones(1 << 20)
        del y
    return step


def _worker(rank: int, world_size: int, store_path: str, cases: list, warmup: int, steps: int,
            out_dir: str) -> None:
    from autotune.runtime.event_table import is_communication
    from autotune.runtime.profiling import StepProfiler, communication_intervals, intersect, step_spans, total
    from autotune.runtime.torch_compat import track_cpu_allocations

    torch.set_num_threads(1)
    tracked = track_cpu_allocations()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    results = []
    for make, options in cases:
        step = make(rank, **options)
        with StepProfiler(torch.device("cpu"), warmup, steps, allocator_tracked=tracked) as profiler:
            for _ in range(warmup + steps):
                dist.barrier()  # ranks start each step together, outside the measured span
                with profiler.step():
                    step()
        figures = profiler.figures
        comm = communication_intervals(profiler.events)
        mine = dict(dataclasses.asdict(figures), comm_fraction=figures.comm_fraction,
                    exposed_comm_fraction=figures.exposed_comm_fraction,
                    step_comm_s=[total(intersect(comm, [span])) / 1e9 for span in step_spans(profiler.events)],
                    comm_events=sorted({e.name for e in profiler.events if is_communication(e)}))
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        results.append(everyone)
        del step
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def profile_workloads(world_size: int, cases: list, warmup: int = 1, steps: int = 3) -> list[list[dict]]:
    """For each (make, options): the RankFigures of every rank, as dicts with the fractions
    `step_comm_s`, the communication time inside each measured step, and `comm_events`, the
    names of the events counted as communication."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), cases, warmup, steps, tmp),
                           nprocs=world_size, start_method="spawn")
        return json.loads(Path(tmp, "results.json").read_text())
