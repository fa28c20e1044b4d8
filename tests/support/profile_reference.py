"""The per-event reading of a profile that runtime/event_table.py replaced, kept as the
oracle its columns are checked against: one Python object per event, the `c10d::`
operators an allocation happened in found by walking the event tree by name.

`both_readings` runs trials on real gloo ranks and reads each rank's one profile both
ways, so a test compares the two on the same events."""

from __future__ import annotations

import dataclasses

from torch.autograd import DeviceType

from autotune.runtime.event_table import CPU_PREFIXES, GLOO_POINT_TO_POINT, STEP_EVENT, Event, is_communication
from autotune.runtime.memory import SCRATCH_OPERATORS, MemoryEvent, levels, step_peaks
from autotune.runtime.profiling import BLOCKING_COMM_PREFIXES, intersect, subtract, total
from autotune.runtime.torch_compat import ProfilerEventType


def union(intervals) -> list[tuple[int, int]]:
    """The interval union as it was, one interval at a time."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def read_events(result) -> list[Event]:
    events = []
    for e in result.events():
        name = e.name()
        if e.device_type() == DeviceType.CUDA:
            events.append(Event(name, e.activity_type(), "cuda", e.start_thread_id(), e.start_ns(), e.end_ns()))
        elif name.startswith(CPU_PREFIXES):
            events.append(Event(name, e.activity_type(), "cpu", e.start_thread_id(), e.start_ns(), e.end_ns()))
    return events


def gloo_worker_threads(events: list[Event]) -> set[int]:
    return {e.thread for e in events if e.device == "cpu" and e.name.startswith("gloo:")
            and e.name not in GLOO_POINT_TO_POINT}


def memory_events(result, gloo_threads: set[int]) -> list[MemoryEvent]:
    events, stack = [], [(node, False) for node in result.experimental_event_tree()]
    while stack:
        node, in_collective = stack.pop()
        inside = in_collective or node.name.startswith(SCRATCH_OPERATORS)
        if node.tag == ProfilerEventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append(MemoryEvent(node.start_time_ns, fields.total_allocated, fields.alloc_size, fields.ptr,
                                          inside or node.start_tid in gloo_threads))
        else:
            stack.extend((child, inside) for child in node.children)
    events.sort()
    return events


def figures(result, resident: int, allocator_tracked: bool) -> dict:
    """The figures of one CPU profile, read event by event."""
    events = read_events(result)
    steps = sorted(e.interval for e in events if e.device == "cpu" and e.name == STEP_EVENT)
    memory = memory_events(result, gloo_worker_threads(events))
    if allocator_tracked and memory:
        resident = memory[0].total - memory[0].size
    peaks = step_peaks(levels(memory, resident), steps, resident)
    comm = intersect(union(e.interval for e in events if is_communication(e)), union(steps))
    workers = gloo_worker_threads(events)
    mine = [e for e in events if e.device == "cpu" and e.thread not in workers]
    compute = subtract(union(e.interval for e in mine if e.name.startswith("aten::")),
                       union(e.interval for e in mine if e.name.startswith(BLOCKING_COMM_PREFIXES)))
    return {"step_times_s": [(end - start) / 1e9 for start, end in steps], "comm_s": total(comm) / 1e9,
            "exposed_comm_s": total(subtract(comm, compute)) / 1e9, "step_peak_mem_bytes": peaks,
            "resident_mem_bytes": resident, "memory_events": len(memory),
            "scratch_events": sum(m.scratch for m in memory)}


def both_readings(layouts: list[str], model: str = "tiny") -> list[dict]:
    """On each rank, per layout: {"columns": the shipped reading, "per_event": this one}."""
    from autotune.config import load_model
    from autotune.runtime import profiling, trial
    from autotune.trialspec import TrialSpec

    readings = []
    shipped = profiling.StepProfiler._trace_ready

    def read_twice(self, prof):
        shipped(self, prof)
        result = prof.profiler.kineto_results
        columns = {k: v for k, v in dataclasses.asdict(self.figures).items() if k in (
            "step_times_s", "comm_s", "exposed_comm_s", "step_peak_mem_bytes", "resident_mem_bytes")}
        resident = self._resident
        readings.append({"columns": columns, "per_event": figures(result, resident, self.allocator_tracked)})

    profiling.StepProfiler._trace_ready = read_twice
    try:
        cfg = dataclasses.asdict(load_model(model))
        for layout in layouts:
            trial.run(TrialSpec(model=cfg, layout=layout, steps=2, warmup=1))
    finally:
        profiling.StepProfiler._trace_ready = shipped
    return readings
