"""Peak memory of a rank: the bytes of live tensors, as CUDA's `max_memory_allocated` counts them.

Definition. Each measured step's peak is the most bytes the allocator held for tensors
during that step: live tensors, including those collectives and DTensor redistributions
allocate, excluding a communication backend's own scratch (a GPU run's NCCL keeps that
outside torch's allocator). A rank's peak is the least of its steps' peaks; the trial's
is the largest over ranks. The least, because a step's peak can only rise by a buffer that
a collective backend's thread lets go of after the program did (below), never fall: the
steps of a steady run hold the same tensors in the same order, so the lowest step is the
one whose frees all came in program order, which is what a CUDA run counts. Under expert
parallel a step also holds what its routing sends it (uneven all-to-alls), so there the
least is the measured step with the lightest routing; the estimator prices even routing.

CUDA: the caching allocator's statistics, reset at the start of every measured step.

CPU: the allocator's own running total. With c10's `caffe2_report_cpu_memory_usage` on
(torch_compat.track_cpu_allocations) every CPU allocation and free updates one counter,
on any thread, and the profiler's memory events carry it (`total_allocated`); the
level after each event is that total. Three rules make that level the peak a CUDA run
would count (benchmarks/cpu_peak_memory.md has the measurements behind each):
- The allocator's total, not a sum of the profiler's events: a free on a gloo worker
  thread outside the collective it served is not recorded as an event, so a sum of events
  drifts up step after step.
- gloo's own scratch is left out, as NCCL's is outside torch's allocator: allocations on
  gloo's worker threads and inside `c10d::` operators do not count between their
  allocation and their free; a block freed unseen (the total falls with no event) stops
  counting where the total falls.
- The caller's buffers are freed in program order: FSDP's all-gather on the CPU returns
  only once gloo has let go of its output (parallel/gloo_release.py), and the least step
  is taken for the other collectives' buffers, since a late free only raises a step.
Without the flag (a torch build whose c10 library does not export it) the level is the
tensors Python reaches when measuring starts plus the running sum of the recorded
events, which over-counts as described; the result then says so (`memory_source`).
"""

from __future__ import annotations

import gc
from typing import NamedTuple

import numpy as np
import torch

from autotune.runtime.event_table import paused_gc, union_arrays
from autotune.runtime.torch_compat import is_traceable_wrapper_subclass

SCRATCH_OPERATORS = "c10d::"  # a backend's collective: what it allocates inside is its own


class MemoryEvent(NamedTuple):
    """One allocation (size > 0) or free (size < 0) the profiler recorded."""

    time_ns: int
    total: int  # the allocator's live bytes after the event (of the blocks it tracks)
    size: int
    ptr: int
    scratch: bool  # allocated by a communication backend for itself


def memory_events(nodes: list, events) -> list[MemoryEvent]:
    """The CPU allocation events of a profile, in time order, each marked as a backend's
    scratch when it happens on a gloo worker thread or inside a `c10d::` operator.

    `nodes`: the profile's allocation nodes, `events` its EventTable, as
    event_table.read_cpu_profile reads them; the `c10d::` operators say, by their spans on
    each thread, which allocations they made: an allocation is a child of the operator it
    happened in, on the same thread, inside its span."""
    with paused_gc():  # a CPU trial's profile: every allocation is on the CPU (a GPU's are not read here)
        fields = [node.extra_fields for node in nodes]
        allocations = list(zip([node.start_time_ns for node in nodes], [f.total_allocated for f in fields],
                               [f.alloc_size for f in fields], [f.ptr for f in fields],
                               [node.start_tid for node in nodes]))
    if not allocations:
        return []
    times = np.array([a[0] for a in allocations], dtype=np.int64)
    threads = np.array([a[4] for a in allocations], dtype=np.int64)
    scratch = np.isin(threads, np.array(sorted(events.gloo_worker_threads()), dtype=np.int64))
    operators = events.named(SCRATCH_OPERATORS) & ~events.cuda
    for thread in np.unique(events.thread[operators]).tolist():
        mine = operators & (events.thread == thread)
        spans = union_arrays(events.start[mine], events.end[mine])
        starts = np.array([s for s, _ in spans], dtype=np.int64)
        ends = np.array([e for _, e in spans], dtype=np.int64)
        on_thread = np.flatnonzero(threads == thread)
        span = np.searchsorted(starts, times[on_thread], side="right") - 1
        inside = (span >= 0) & (times[on_thread] <= ends[np.maximum(span, 0)])
        scratch[on_thread[inside]] = True
    with paused_gc():
        marked = [MemoryEvent(a[0], a[1], a[2], a[3], bool(flag)) for a, flag in zip(allocations, scratch.tolist())]
        marked.sort()
    return marked


def levels(events: list[MemoryEvent], start_level: int) -> list[tuple[int, int]]:
    """(time, bytes of live tensors) after each event: start_level plus the allocator's
    change since the first event, less the backend scratch alive at that moment.

    A scratch block counts as scratch from its allocation to its free. Where the profiler
    did not record the free (gloo's worker thread let go of the block), the free is where
    the allocator's total fell by the block's size with no recorded event to explain it
    (unrecorded_frees), the block being the latest open one of that size; a block the
    total never shows leaving stays counted, on the safe side."""
    if not events:
        return []
    freed_at = scratch_lifetimes(events)
    base = events[0].total - events[0].size
    change = np.zeros(len(events) + 1, dtype=np.int64)
    for allocated, freed in freed_at.items():
        change[allocated] -= events[allocated].size
        change[freed] += events[allocated].size
    totals = np.fromiter((e.total for e in events), dtype=np.int64, count=len(events))
    live = start_level + totals - base + np.cumsum(change[:-1])
    with paused_gc():  # 10^5 tuples: the collector's passes over the profile's objects would cost more
        return list(zip([e.time_ns for e in events], live.tolist()))


def scratch_lifetimes(events: list[MemoryEvent]) -> dict[int, int]:
    """{index of a scratch allocation: index of the event at which it is gone}: its
    recorded free, else the first unexplained fall of the total by its size while it
    could still be alive (before its address was handed out again)."""
    freed_at, open_blocks, unrecorded = {}, {}, []  # unrecorded: (allocated, address reused at)
    for i, e in enumerate(events):
        if e.size > 0 and e.ptr in open_blocks:  # the address again: the block went unseen
            unrecorded.append((open_blocks.pop(e.ptr), i))
        if e.size > 0 and e.scratch:
            open_blocks[e.ptr] = i
        elif e.size < 0 and e.ptr in open_blocks:
            freed_at[open_blocks.pop(e.ptr)] = i
    unrecorded += [(allocated, len(events)) for allocated in open_blocks.values()]
    if not unrecorded:
        return freed_at
    candidates: dict[int, list[tuple[int, int]]] = {}
    for allocated, deadline in sorted(unrecorded):
        candidates.setdefault(events[allocated].size, []).append((allocated, deadline))
    for i, fall in unrecorded_frees(events):
        blocks = candidates.get(fall, [])
        for k in range(len(blocks) - 1, -1, -1):  # the latest allocated that can be the one
            allocated, deadline = blocks[k]
            if allocated < i <= deadline:
                freed_at[allocated] = i
                del blocks[k]
                break
    return freed_at


def unrecorded_frees(events: list[MemoryEvent]) -> list[tuple[int, int]]:
    """(index, bytes) where the allocator's total after an event is below the total
    before it plus its size: blocks freed in between without a recorded event."""
    totals = np.array([e.total for e in events], dtype=np.int64)
    sizes = np.array([e.size for e in events], dtype=np.int64)
    falls = totals[:-1] + sizes[1:] - totals[1:]
    where = np.flatnonzero(falls > 0)
    return list(zip((where + 1).tolist(), falls[where].tolist()))


def step_peaks(timeline: list[tuple[int, int]], spans: list[tuple[int, int]], start_level: int) -> list[int]:
    """Each step's peak: the highest level inside its span, or the level it starts at."""
    peaks, level, i = [], start_level, 0
    for start, end in spans:
        while i < len(timeline) and timeline[i][0] < start:
            level = timeline[i][1]
            i += 1
        peak = level
        while i < len(timeline) and timeline[i][0] <= end:
            level = timeline[i][1]
            peak = max(peak, level)
            i += 1
        peaks.append(peak)
    return peaks


def rank_peak(peaks: list[int]) -> int:
    """A rank's peak: the least of its measured steps' peaks (module docstring: a late free
    only ever raises a step)."""
    return min(peaks, default=0)


def cpu_peak_during(fn) -> int:
    """The most bytes the CPU allocator held while fn() ran, above what it held when fn
    began, in one thread without collectives (a kernel's working set; trials measure
    through StepProfiler). Needs torch_compat.track_cpu_allocations() on."""
    from torch.profiler import profile

    from autotune.runtime.event_table import read_cpu_profile

    with profile(profile_memory=True) as prof:
        fn()
    _, nodes = read_cpu_profile(prof.profiler.kineto_results)
    if not nodes:
        return 0
    nodes.sort(key=lambda node: node.start_time_ns)
    before = nodes[0].extra_fields.total_allocated - nodes[0].extra_fields.alloc_size
    return max(0, max(node.extra_fields.total_allocated for node in nodes) - before)


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the storages of every tensor on `device` that Python can reach, each once
    (the fallback's starting level). Wrapper subclasses (DTensor) own no storage; their
    local tensors are found on their own."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or is_traceable_wrapper_subclass(obj):
            continue
        if obj.device.type != device.type or obj.layout != torch.strided:
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage of its own (a functional or fake tensor)
            continue
        if storage.nbytes():
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())
