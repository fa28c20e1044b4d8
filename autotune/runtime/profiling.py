"""torch.profiler -> step times, communication and compute intervals, peak memory, per rank.

A trial runs `warmup + steps` optimizer steps; the profiler's schedule skips the
warm-up and records the last `steps` on every rank. From the recorded events:

- step wall times: the `autotune.step` annotation that wraps each step (the device is
  synchronised at both ends, so on a GPU it covers the kernels too);
- communication: on the CPU, the `gloo:*` events. In torch 2.13 gloo emits a
  `gloo:<collective>` annotation (all_reduce, all_gather, all_to_all, broadcast,
  barrier, ...; a reduce-scatter shows as `gloo:all_reduce`) on its worker threads, and
  `gloo:send` / `gloo:recv` on the thread that posted a point-to-point transfer, each
  ending when the transfer completes. On a GPU, the `nccl*` kernels on any stream. Several
  threads and streams run at once, so they are merged into one interval union. An event
  covers the whole collective including the time spent waiting for the slowest rank:
  waiting counts as communication, as it does for an NCCL kernel spinning on a GPU;
- compute: on the CPU, the `aten::*` operators on every thread except gloo's worker
  threads (whose operators are the copies and sums of a collective), minus the blocking
  communication calls nested in them (a DTensor operator waits for its redistribution
  inside its own `aten::` event); on a GPU, every kernel that is not NCCL's;
- exposed communication: communication not overlapped by compute.

Peak memory is bytes of live tensors, not process RSS, defined and measured in
runtime/memory.py: per measured step, the allocator's highest level; per rank, the
least of the steps (a backend's thread can only free late).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from autotune.runtime.event_table import (
    BLOCKING_COMM_PREFIXES,
    STEP_EVENT,
    Event,
    EventTable,
    Interval,
    paused_gc,
    read_cpu_profile,
    read_events,
    union_arrays,
)
from autotune.runtime.memory import levels, live_tensor_bytes, memory_events, rank_peak, step_peaks

# -- interval arithmetic -----------------------------------------------------------------------

def union(intervals) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the same time as the input."""
    pairs = np.array(list(intervals), dtype=np.int64).reshape(-1, 2)
    return union_arrays(pairs[:, 0], pairs[:, 1])


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Time covered by both (inputs are unions, as `union` returns)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Time covered by a and not by b (inputs are unions)."""
    out = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def total(intervals: list[Interval]) -> int:
    return sum(end - start for start, end in intervals)


# -- events (runtime/event_table.py reads and classifies them) --------------------------------

def as_table(events) -> EventTable:
    """Tests and probes pass lists of Events; a profile is read as a table."""
    return events if isinstance(events, EventTable) else EventTable.from_events(events)


def step_spans(events) -> list[Interval]:
    table = as_table(events)
    mask = ~table.cuda & table.by_name(lambda name: name == STEP_EVENT)
    return sorted(zip(table.start[mask].tolist(), table.end[mask].tolist()))


def communication_intervals(events) -> list[Interval]:
    table = as_table(events)
    return table.intervals(table.communication())


def compute_intervals(events) -> list[Interval]:
    """GPU: non-NCCL kernels. CPU: aten operators off gloo's worker threads, minus the
    blocking communication calls on those threads."""
    table = as_table(events)
    kernels = table.intervals(table.kernels() & ~table.communication())
    workers = np.array(sorted(gloo_worker_threads(table)), dtype=np.int64)
    on_compute_threads = ~table.cuda & ~np.isin(table.thread, workers)
    operators = table.intervals(on_compute_threads & table.named("aten::"))
    blocking = table.intervals(on_compute_threads & table.named(*BLOCKING_COMM_PREFIXES))
    return union(kernels + subtract(operators, blocking))


def gloo_worker_threads(events) -> set[int]:
    """The threads gloo runs its collectives on (point-to-point transfers show on the
    thread that posted them, which computes too)."""
    return as_table(events).gloo_worker_threads()


# -- one rank's figures ------------------------------------------------------------------------

@dataclass
class RankFigures:
    """What one rank measured over the measured steps."""

    step_times_s: list[float]
    comm_s: float  # union of communication intervals inside the steps
    exposed_comm_s: float  # the part of it not overlapped by compute
    peak_mem_bytes: int  # the least of step_peak_mem_bytes (runtime/memory.py)
    resident_mem_bytes: int  # tensors alive when measuring started
    step_peak_mem_bytes: list[int] = field(default_factory=list)
    memory_source: str = ""  # allocator (CPU running total), allocator statistics (CUDA), profiler events
    # CUDA: the most the caching allocator held from the device over the measured steps
    # (torch.cuda.max_memory_reserved): live tensors plus the blocks it caches and cannot reuse.
    # The CPU allocator caches nothing, so there it is None.
    reserved_mem_bytes: int | None = None
    trace_file: str | None = None
    # CPU: bytes handed to gloo per measured step, by collective (gloo:all_gather, gloo:send, ...):
    # the input buffers of the gloo events that start inside the steps. None on a GPU.
    comm_bytes_per_step: dict[str, int] | None = None

    @property
    def measured_s(self) -> float:
        return sum(self.step_times_s)

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.measured_s

    @property
    def exposed_comm_fraction(self) -> float:
        return self.exposed_comm_s / self.measured_s


def analyze(events: EventTable | list[Event], step_peak_mem_bytes: list[int], resident_mem_bytes: int,
            memory_source: str = "", reserved_mem_bytes: int | None = None) -> RankFigures:
    """Step times and (exposed) communication time of one rank's recorded events, with the
    memory figures measured beside them."""
    events = as_table(events)
    steps = step_spans(events)
    in_steps = union(steps)
    comm = intersect(communication_intervals(events), in_steps)
    exposed = subtract(comm, compute_intervals(events))
    return RankFigures(step_times_s=[(end - start) / 1e9 for start, end in steps],
                       comm_s=total(comm) / 1e9, exposed_comm_s=total(exposed) / 1e9,
                       peak_mem_bytes=rank_peak(step_peak_mem_bytes), resident_mem_bytes=resident_mem_bytes,
                       step_peak_mem_bytes=list(step_peak_mem_bytes), memory_source=memory_source,
                       reserved_mem_bytes=reserved_mem_bytes, comm_bytes_per_step=comm_bytes(events, steps))


def comm_bytes(events: EventTable, steps: list[Interval]) -> dict[str, int] | None:
    """Bytes per measured step handed to each gloo collective, from the events' recorded
    input shapes; None where none were recorded (a GPU profile)."""
    if events.nbytes is None or not steps:
        return None
    inside = np.zeros(len(events), dtype=bool)
    for start, end in steps:
        inside |= (events.start >= start) & (events.start < end)
    mask = inside & (events.nbytes > 0)
    per_kind: dict[str, int] = {}
    for code, nbytes in zip(events.code[mask].tolist(), events.nbytes[mask].tolist()):
        name = events.names[code]
        per_kind[name] = per_kind.get(name, 0) + nbytes
    return {name: round(value / len(steps)) for name, value in sorted(per_kind.items())}


# -- the profiler around a training loop -------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """StepProfiler's interface without torch.profiler: wall times of the measured steps
    only (communication and memory figures are zero and reported as not measured)."""

    def __init__(self, device: torch.device, warmup: int, steps: int):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.times: list[float] = []

    def __enter__(self) -> "StepTimer":
        return self

    def __exit__(self, *exc) -> None:
        pass

    @contextlib.contextmanager
    def step(self):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.times.append(time.perf_counter() - start)

    @property
    def figures(self) -> "RankFigures":
        return RankFigures(step_times_s=self.times[self.warmup:], comm_s=0.0, exposed_comm_s=0.0,
                           peak_mem_bytes=0, resident_mem_bytes=0)


class StepProfiler:
    """Profile the last `steps` of a loop of `warmup + steps` steps on this rank:

        with StepProfiler(device, warmup, steps) as profiler:
            for _ in range(warmup + steps):
                inputs = ...
                with profiler.step():
                    train_step(inputs)
        profiler.figures  # RankFigures

    The profiler's own warm-up (tracing set up, events dropped) is the last warm-up step,
    so that starting the tracer costs no measured step. Memory events are recorded on
    the CPU only; CUDA has allocator statistics. `allocator_tracked`: whether the CPU
    allocator counts every thread's allocations (torch_compat.track_cpu_allocations,
    turned on before the model was built); see runtime/memory.py.
    """

    def __init__(self, device: torch.device, warmup: int, steps: int, trace_file: str | None = None,
                 allocator_tracked: bool = False):
        self.device, self.warmup, self.steps, self.trace_file = device, warmup, steps, trace_file
        self.allocator_tracked = allocator_tracked
        self.figures: RankFigures | None = None
        self.events = EventTable.from_events([])  # what the figures were computed from
        self._done = 0
        self._failing = False
        self._resident = 0
        self._cuda_step_peaks: list[int] = []
        self._cuda_reserved: int | None = None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with warnings.catch_warnings():  # "won't be using warmup": intended when warmup is 0
            warnings.simplefilter("ignore")
            measured = schedule(wait=max(warmup - 1, 0), warmup=min(warmup, 1), active=steps, repeat=1)
        # On the CPU shapes are recorded too, for the bytes each gloo collective moves.
        self._profiler = profile(activities=activities, schedule=measured, on_trace_ready=self._trace_ready,
                                 profile_memory=device.type == "cpu", record_shapes=device.type == "cpu")

    def __enter__(self) -> "StepProfiler":
        self._profiler.__enter__()
        if self.warmup == 0:
            self._start_measuring()
        return self

    def __exit__(self, *exc) -> None:
        self._failing = exc[0] is not None  # the loop raised: analyse nothing, let its error through
        self._profiler.__exit__(*exc)
        if exc[0] is None and self.figures is None:
            raise RuntimeError(f"StepProfiler: {self._done} steps run, {self.warmup + self.steps} expected")

    @contextlib.contextmanager
    def step(self):
        """One training step: timed between two device synchronisations."""
        synchronize(self.device)
        measured = self._done >= self.warmup
        if measured and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with record_function(STEP_EVENT):
            yield
            synchronize(self.device)
        if measured and self.device.type == "cuda":
            self._cuda_step_peaks.append(torch.cuda.max_memory_allocated(self.device))
            self._cuda_reserved = max(self._cuda_reserved or 0, torch.cuda.max_memory_reserved(self.device))
        self._done += 1
        self._profiler.step()  # after the last measured step this stops and analyses
        if self._done == self.warmup:
            self._start_measuring()

    def _start_measuring(self) -> None:
        """The recording has just begun: note what is resident."""
        if self.device.type == "cuda":
            self._resident = torch.cuda.memory_allocated(self.device)
        elif not self.allocator_tracked:
            self._resident = live_tensor_bytes(self.device)

    def _trace_ready(self, prof) -> None:
        if self._failing:
            return
        # 10^5 events become intervals, tuples and arrays: a pass of Python's cyclic collector
        # over them and the rest of the process cost up to 0.9 s of a 3 s one-rank tiny trial.
        with paused_gc():
            self._read(prof)

    def _read(self, prof) -> None:
        result = prof.profiler.kineto_results
        if self.device.type == "cuda":
            self.events = read_events(result)
            peaks, resident, source = self._cuda_step_peaks, self._resident, "allocator statistics"
        else:
            self.events, allocations = read_cpu_profile(result)
            memory = memory_events(allocations, self.events)
            resident = self._resident
            if self.allocator_tracked and memory:
                resident = memory[0].total - memory[0].size
            timeline = levels(memory, resident)
            peaks = step_peaks(timeline, step_spans(self.events), resident)
            source = "allocator" if self.allocator_tracked else "profiler events"
        self.figures = analyze(self.events, peaks, resident, source, self._cuda_reserved)
        if len(self.figures.step_times_s) != self.steps:
            raise RuntimeError(f"StepProfiler: recorded {len(self.figures.step_times_s)} steps, "
                               f"expected {self.steps}")
        if self.trace_file:
            prof.export_chrome_trace(self.trace_file)
            self.figures.trace_file = self.trace_file
