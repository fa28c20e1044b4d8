"""The profiler's events as columns: read once, classified by name, analysed with numpy.

A measured step of a small model on the CPU records some 10^5 events (3 steps of tiny on
one rank: 422,667, a quarter of them memory records). Made into one Python object each and
merged interval by interval, reading them back took longer than the steps themselves
(5.1 s for 3 steps of 0.6 s). Here each event costs a few accessor calls; names are
classified once per distinct name (a few hundred), and the interval arithmetic over the
whole table runs in numpy. The figures are the same as the per-event reading's
(tests/test_profiling.py compares both on one real trace).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from torch.autograd import DeviceType

from autotune.runtime.torch_compat import ProfilerEventType

STEP_EVENT = "autotune.step"
GLOO_PREFIX = "gloo:"
GLOO_POINT_TO_POINT = ("gloo:send", "gloo:recv")
# Operators by which a compute thread issues or waits for a collective: not compute.
BLOCKING_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
# CPU events the analysis reads; the rest (autograd and module annotations, memory
# records, Python-level ops) are dropped when the profiler's result is read.
CPU_PREFIXES = ("aten::", GLOO_PREFIX, STEP_EVENT) + BLOCKING_COMM_PREFIXES

Interval = tuple[int, int]  # [start, end) in nanoseconds


class Event(NamedTuple):
    """One event, as tests write them and as iterating a table yields them."""

    name: str
    kind: str  # GPU profiles: the activity type (kernel, gpu_memcpy, cpu_op, ...); CPU profiles: "cpu"
    device: str  # "cpu" or "cuda"
    thread: int
    start_ns: int
    end_ns: int

    @property
    def interval(self) -> Interval:
        return (self.start_ns, self.end_ns)


def is_communication(e: Event) -> bool:
    """gloo's annotations on the CPU; NCCL's kernels on a GPU (not NCCL's CPU-side
    `nccl:*` annotations, which end when the kernel is enqueued)."""
    if e.device == "cpu":
        return e.name.startswith(GLOO_PREFIX)
    return e.kind == "kernel" and e.name.lower().startswith("nccl")


@dataclass
class EventTable:
    """Events as parallel columns; `names[code[i]]` is event i's name."""

    names: list[str]
    code: np.ndarray  # int, index into names
    kind_names: list[str]
    kind: np.ndarray  # int, index into kind_names
    cuda: np.ndarray  # bool: a GPU event
    thread: np.ndarray  # int64
    start: np.ndarray  # int64 ns
    end: np.ndarray  # int64 ns
    # CPU profiles recorded with shapes: bytes of each gloo event's input tensors (0 for other events)
    nbytes: np.ndarray | None = None

    @classmethod
    def from_events(cls, events) -> "EventTable":
        events = list(events)
        names, kinds = _Codes(), _Codes()
        code = np.array([names[e.name] for e in events], dtype=np.int64)
        kind = np.array([kinds[e.kind] for e in events], dtype=np.int64)
        return cls(names=names.values, code=code, kind_names=kinds.values, kind=kind,
                   cuda=np.array([e.device == "cuda" for e in events], dtype=bool),
                   thread=np.array([e.thread for e in events], dtype=np.int64),
                   start=np.array([e.start_ns for e in events], dtype=np.int64),
                   end=np.array([e.end_ns for e in events], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.code)

    def __iter__(self):
        for i in range(len(self)):
            yield Event(self.names[self.code[i]], self.kind_names[self.kind[i]],
                        "cuda" if self.cuda[i] else "cpu", int(self.thread[i]), int(self.start[i]), int(self.end[i]))

    # -- masks, from each distinct name once --------------------------------------------------

    def by_name(self, test) -> np.ndarray:
        """Whether each event's name passes `test`, asked once per distinct name."""
        per_name = np.array([bool(test(name)) for name in self.names], dtype=bool)
        return per_name[self.code] if len(self.code) else np.zeros(0, dtype=bool)

    def named(self, *prefixes: str) -> np.ndarray:
        return self.by_name(lambda name: name.startswith(prefixes))

    def kernels(self) -> np.ndarray:
        is_kernel = np.array([k == "kernel" for k in self.kind_names], dtype=bool)
        return self.cuda & (is_kernel[self.kind] if len(self.kind) else np.zeros(0, dtype=bool))

    def communication(self) -> np.ndarray:
        """is_communication, for every event at once."""
        nccl = self.by_name(lambda name: name.lower().startswith("nccl"))
        return (~self.cuda & self.named(GLOO_PREFIX)) | (self.kernels() & nccl)

    def gloo_worker_threads(self) -> set[int]:
        """The threads gloo runs its collectives on (point-to-point transfers show on the
        thread that posted them, which computes too)."""
        collective = self.by_name(lambda name: name.startswith(GLOO_PREFIX) and name not in GLOO_POINT_TO_POINT)
        return set(np.unique(self.thread[~self.cuda & collective]).tolist())

    def intervals(self, mask: np.ndarray) -> list[Interval]:
        return union_arrays(self.start[mask], self.end[mask])


class _Codes(dict):
    """Distinct values numbered in order of first sight."""

    def __missing__(self, value):
        self[value] = len(self)
        return self[value]

    @property
    def values(self) -> list:
        return list(self.keys())


def read_events(result) -> EventTable:
    """A GPU profile's events: every GPU event and the CPU events the analysis reads. A
    CPU profile is read from its event tree instead (read_cpu_profile), which holds its
    allocations too."""
    with paused_gc():
        events = result.events()
        all_names = [e.name() for e in events]
        names = _Codes()
        codes = np.array([names[name] for name in all_names], dtype=np.int64)
        read_on_cpu = np.array([name.startswith(CPU_PREFIXES) for name in names.values], dtype=bool)
        cuda = np.array([e.device_type() == DeviceType.CUDA for e in events], dtype=bool)
        keep = np.flatnonzero(cuda | read_on_cpu[codes])
        kept = [events[i] for i in keep]
        kinds = _Codes()
        kind = np.array([kinds[e.activity_type()] for e in kept], dtype=np.int64)
        times = np.array([(e.start_ns(), e.end_ns(), e.start_thread_id()) for e in kept], dtype=np.int64)
        times = times.reshape(-1, 3)
        return EventTable(names=names.values, code=codes[keep], kind_names=kinds.values, kind=kind, cuda=cuda[keep],
                          thread=times[:, 2], start=times[:, 0], end=times[:, 1])


def read_cpu_profile(result) -> tuple[EventTable, list]:
    """A CPU profile's events the analysis reads, and its allocation records (the event
    tree's Allocation nodes, for runtime/memory.py), in one walk of the profiler's event
    tree.

    Why the tree: a CPU trial's peak memory needs the allocations' fields (the allocator's
    total, the address), which only the tree's nodes carry. Reading the operators from the
    same walk, instead of again from `result.events()`, halves the read-back (on tiny at
    tp=2, 169,402 operators and 45,144 allocations a rank: 3.5 s + 3.2 s read in two
    passes). The tree holds the same CPU operators as `result.events()`, with the same
    times and threads (tests/test_profiling.py compares the figures with a reading of
    `result.events()`). Their kind is "cpu": nothing reads a CPU event's kind."""
    allocation = ProfilerEventType.Allocation
    with paused_gc():
        stack = list(result.experimental_event_tree())
        pop, extend = stack.pop, stack.extend
        allocations, operators = [], []
        keep_allocation, keep_operator = allocations.append, operators.append
        while stack:  # every node once (10^5 a step): one tag read, then its children
            node = pop()
            if node.tag == allocation:
                keep_allocation(node)
            else:
                keep_operator(node)
                extend(node.children)
        names = _Codes()
        codes = np.array([names[node.name] for node in operators], dtype=np.int64)
        read = np.array([name.startswith(CPU_PREFIXES) for name in names.values], dtype=bool)
        keep = np.flatnonzero(read[codes]) if len(codes) else np.zeros(0, dtype=np.int64)
        times = np.array([(node.start_time_ns, node.end_time_ns, node.start_tid)
                          for node in map(operators.__getitem__, keep.tolist())], dtype=np.int64).reshape(-1, 3)
        gloo = np.array([name.startswith(GLOO_PREFIX) for name in names.values], dtype=bool)
        nbytes = np.zeros(len(keep), dtype=np.int64)
        for row in np.flatnonzero(gloo[codes[keep]]).tolist():
            nbytes[row] = input_bytes(operators[keep[row]])
        table = EventTable(names=names.values, code=codes[keep], kind_names=["cpu"],
                           kind=np.zeros(len(keep), dtype=np.int64), cuda=np.zeros(len(keep), dtype=bool),
                           thread=times[:, 2], start=times[:, 0], end=times[:, 1], nbytes=nbytes)
    return table, allocations


def input_bytes(node) -> int:
    """Bytes of an operator's input tensors, from the shapes and dtypes the profiler
    recorded (record_shapes; none recorded: 0). For a gloo event: the buffer it sends, or
    for a receive the buffer it fills."""
    total = 0
    for tensor in getattr(node.extra_fields, "inputs", ()):
        sizes, dtype = getattr(tensor, "sizes", None), getattr(tensor, "dtype", None)
        if sizes is not None and dtype is not None:
            total += math.prod(sizes) * dtype.itemsize
    return total


class paused_gc:
    """Python's cyclic collector off while 10^5 short-lived objects are made: each
    generation-0 pass would walk every tracked object, and reading a profile that way
    took twice as long (3.6 s against 1.5 s for the same events)."""

    def __enter__(self):
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self.was_enabled:
            gc.enable()


def union_arrays(starts: np.ndarray, ends: np.ndarray) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as [starts, ends): sorted by
    start, a new interval begins where a start lies past every earlier end (touching
    intervals merge)."""
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if not len(starts):
        return []
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    begins = np.flatnonzero(np.concatenate(([True], starts[1:] > reach[:-1])))
    stops = np.concatenate((begins[1:] - 1, [len(starts) - 1]))
    return list(zip(starts[begins].tolist(), reach[stops].tolist()))
