"""runtime/profiling.py: interval arithmetic, event classification, and the figures it
measures on synthetic workloads whose truth is known by construction (real gloo ranks)."""

import random
import statistics

import pytest

from autotune.runtime.memory import MemoryEvent, levels, rank_peak, step_peaks
from autotune.runtime.profiling import (
    STEP_EVENT,
    Event,
    analyze,
    compute_intervals,
    intersect,
    subtract,
    total,
    union,
)
from support import workloads
from support.workloads import profile_workloads

# -- interval arithmetic ------------------------------------------------------------------------


def covered(intervals) -> set[int]:
    return {t for start, end in intervals for t in range(start, end)}


def test_union_merges_nested_touching_and_overlapping_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (10, 20), (12, 15), (8, 8)]) == [(0, 4), (5, 7), (10, 20)]
    assert union([]) == []
    assert total(union([(0, 10), (5, 15), (20, 21)])) == 16


def test_intersect_and_subtract_by_hand():
    a, b = [(0, 10), (20, 30)], [(5, 25)]
    assert intersect(a, b) == [(5, 10), (20, 25)]
    assert subtract(a, b) == [(0, 5), (25, 30)]
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert subtract([(0, 10)], [(0, 10)]) == [] and subtract([(0, 10)], []) == [(0, 10)]


def test_interval_arithmetic_matches_sets_of_points():
    rng = random.Random(0)
    for _ in range(300):
        raw_a = [(s, s + rng.randint(0, 15)) for s in (rng.randint(0, 80) for _ in range(rng.randint(0, 6)))]
        raw_b = [(s, s + rng.randint(0, 15)) for s in (rng.randint(0, 80) for _ in range(rng.randint(0, 6)))]
        a, b = union(raw_a), union(raw_b)
        assert covered(a) == covered(raw_a)
        assert all(a[i][1] < a[i + 1][0] for i in range(len(a) - 1))  # disjoint, not touching, sorted
        assert covered(intersect(a, b)) == covered(a) & covered(b)
        assert covered(subtract(a, b)) == covered(a) - covered(b)
        assert total(a) == len(covered(a))


# -- classifying events -------------------------------------------------------------------------

MAIN, GLOO_A, GLOO_B = 1, 2, 3


def cpu(name, thread, start, end, kind="cpu_op"):
    return Event(name=name, kind=kind, device="cpu", thread=thread, start_ns=start, end_ns=end)


def gpu(name, start, end, kind="kernel"):
    return Event(name=name, kind=kind, device="cuda", thread=7, start_ns=start, end_ns=end)


def step(start, end):
    return cpu(STEP_EVENT, MAIN, start, end, kind="user_annotation")


def test_gloo_threads_are_merged_clipped_to_steps_and_exposed_where_no_compute_runs():
    events = [
        step(0, 100), step(200, 300),
        # two worker threads at once: their union counts, not their sum
        cpu("gloo:all_reduce", GLOO_A, 10, 50, "user_annotation"),
        cpu("gloo:all_gather", GLOO_B, 30, 60, "user_annotation"),
        cpu("aten::copy_", GLOO_A, 20, 40),  # inside a collective: not compute
        # between steps: not measured
        cpu("gloo:all_reduce", GLOO_A, 150, 180, "user_annotation"),
        # straddles the start of step 2: only its part inside counts
        cpu("gloo:all_reduce", GLOO_B, 190, 220, "user_annotation"),
        # compute on the main thread hides [40, 60) of the first collective
        cpu("aten::mm", MAIN, 40, 90),
    ]
    figures = analyze(events, step_peak_mem_bytes=[7, 9, 5], resident_mem_bytes=3)
    assert figures.step_times_s == [100e-9, 100e-9]
    assert figures.comm_s == pytest.approx((50 + 20) * 1e-9)
    assert figures.exposed_comm_s == pytest.approx((30 + 20) * 1e-9)
    assert figures.comm_fraction == pytest.approx(70 / 200)
    assert figures.exposed_comm_fraction == pytest.approx(50 / 200)
    assert (figures.peak_mem_bytes, figures.resident_mem_bytes) == (5, 3)  # the least step's peak


def test_point_to_point_is_communication_on_a_thread_that_still_computes():
    # gloo:send/recv sit on the thread that posted them and end when the transfer does.
    events = [step(0, 100), cpu("gloo:recv", MAIN, 0, 60, "user_annotation"), cpu("aten::mm", MAIN, 10, 50)]
    figures = analyze(events, [0], 0)
    assert figures.comm_s == pytest.approx(60e-9)
    assert figures.exposed_comm_s == pytest.approx(20e-9)


def test_waiting_inside_an_operator_is_not_compute():
    # A DTensor matmul redistributes inside its own aten event: the wait is not compute.
    events = [step(0, 100), cpu("aten::mm", MAIN, 0, 100),
              cpu("_c10d_functional::all_gather_into_tensor", MAIN, 10, 12),
              cpu("_c10d_functional::wait_tensor", MAIN, 12, 60),
              cpu("gloo:all_gather", GLOO_A, 11, 58, "user_annotation")]
    assert compute_intervals(events) == [(0, 10), (60, 100)]
    assert analyze(events, [0], 0).exposed_comm_s == pytest.approx(47e-9)


def test_nccl_kernels_are_communication_and_other_kernels_compute():
    events = [step(0, 100),
              cpu("nccl:all_reduce", MAIN, 0, 5, "user_annotation"),  # CPU side: ends at enqueue
              gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20, 80),
              gpu("ampere_sgemm_128x64_tn", 10, 50),
              gpu("Memcpy DtoD (Device -> Device)", 50, 90, kind="gpu_memcpy"),
              gpu(STEP_EVENT, 0, 100, kind="gpu_user_annotation")]
    figures = analyze(events, [0], 0)
    assert figures.comm_s == pytest.approx(60e-9)
    assert figures.exposed_comm_s == pytest.approx(30e-9)
    assert figures.step_times_s == [100e-9]


def memory_stream(*changes):
    """MemoryEvents from (time, size, ptr, scratch) with the allocator's running total,
    starting from 1000 resident bytes; a size of None is a free the profiler did not record
    (its bytes leave the total, no event is made)."""
    events, total = [], 1000
    for time_ns, size, ptr, scratch in changes:
        total += size if size is not None else 0
        if isinstance(ptr, int):
            events.append(MemoryEvent(time_ns, total, size, ptr, scratch))
    return events


def test_the_level_is_the_allocators_total_less_a_backends_scratch():
    events = memory_stream((1, 100, 0xA, False), (2, 50, 0xB, True), (3, -50, 0xB, True),  # closed scratch
                           (4, 70, 0xC, True),  # scratch freed where the profiler could not see: kept
                           (5, -100, 0xA, False), (6, 30, 0xD, False))
    timeline = levels(events, start_level=1000)
    assert [level for _, level in timeline] == [1100, 1100, 1100, 1170, 1070, 1100]
    assert levels([], 1000) == []


def test_a_free_the_profiler_did_not_record_still_lowers_the_level():
    # 0xA's free happens on a thread without the profiler (no event); the total shows it.
    events = [MemoryEvent(1, 1100, 100, 0xA, False), MemoryEvent(3, 1100, 100, 0xB, False)]  # 0xA gone at 2
    assert [level for _, level in levels(events, 1000)] == [1100, 1100]


def test_scratch_freed_unseen_stops_counting_where_the_total_falls_by_its_size():
    events = memory_stream((1, 100, 0xA, False), (2, 70, 0xC, True),
                           (3, -70, None, None),  # gloo's worker thread frees 0xC: no event
                           (4, 30, 0xD, False), (5, 20, 0xE, False))
    assert [level for _, level in levels(events, 1000)] == [1100, 1100, 1130, 1150]
    # The fall matches no scratch block of its size: the block stays counted (safe side).
    events = memory_stream((1, 70, 0xC, True), (2, -60, None, None), (3, 30, 0xD, False))
    assert [level for _, level in levels(events, 1000)] == [1070, 1040]


def test_a_scratch_address_handed_out_again_was_freed_before():
    events = memory_stream((1, 70, 0xC, True), (2, -70, None, None),  # 0xC freed unseen
                           (3, 40, 0xC, True), (4, -40, 0xC, True), (5, 10, 0xD, False))
    assert [level for _, level in levels(events, 1000)] == [1000, 1000, 1000, 1010]


def test_each_step_peaks_inside_its_span_and_a_rank_takes_the_least():
    timeline = [(1, 1100), (2, 1050), (12, 1300), (14, 1000), (22, 1040)]
    assert step_peaks(timeline, [(0, 10), (10, 20), (20, 30), (30, 40)], start_level=1000) == [1100, 1300, 1040, 1040]
    assert rank_peak([1100, 1300, 1040, 1040, 1100]) == 1040  # the others held something freed late
    assert rank_peak([]) == 0


# -- synthetic workloads on two gloo ranks ------------------------------------------------------

SIZES = (1 << 8, 1 << 23, 1 << 25)  # floats all-reduced after a fixed compute
SLEEP_S, STEPS = 0.25, 3
LATE_S = 0.02  # rank 1's lateness in the overlap cases, far shorter than a 1536^3 matmul
EXTRA, RESIDENT = 8 << 20, 16 << 20
CASES = {
    "compute": (workloads.compute_only, {}),
    "communicate": (workloads.communicate_only, {"numel": 1 << 24}),
    **{f"size{n}": (workloads.compute_then_communicate, {"numel": n, "count": 96}) for n in SIZES},
    "punctual": (workloads.late_rank, {"sleep_s": 0.0, "count": 1}),
    "late": (workloads.late_rank, {"sleep_s": SLEEP_S, "count": 1}),
    "overlapped": (workloads.overlapped, {"numel": 1 << 10, "n": 1536, "late_s": LATE_S}),
    "sequential": (workloads.sequential, {"numel": 1 << 10, "n": 1536, "late_s": LATE_S}),
    "every_collective": (workloads.every_collective, {}),
    "late_sender": (workloads.late_sender, {"sleep_s": SLEEP_S}),
    "allocate": (workloads.allocate, {}),
    "allocate_extra": (workloads.allocate, {"extra_bytes": EXTRA}),
    "allocate_resident": (workloads.allocate, {"resident_bytes": RESIDENT}),
    "freed_elsewhere": (workloads.freed_elsewhere, {}),
}


@pytest.fixture(scope="module")
def measured() -> dict:
    """{case: [rank 0's figures, rank 1's]}, all cases profiled in one group of 2 ranks."""
    results = profile_workloads(2, list(CASES.values()), warmup=1, steps=STEPS)
    return dict(zip(CASES, results))


def test_no_collectives_means_no_communication(measured):
    for rank in measured["compute"]:
        assert rank["comm_s"] == 0 and rank["comm_fraction"] == 0 and rank["exposed_comm_fraction"] == 0
        assert len(rank["step_times_s"]) == STEPS and min(rank["step_times_s"]) > 0


def test_only_communicating_is_nearly_all_communication(measured):
    # What is not communication: entering the step, and the time the collective waits for
    # gloo's thread to be scheduled and the step for its own (0.94-0.99 seen on a lightly
    # loaded machine, down to 0.68 with about six busy processes per core).
    for rank in measured["communicate"]:
        assert rank["comm_fraction"] > 0.6, rank
        assert rank["exposed_comm_fraction"] == pytest.approx(rank["comm_fraction"], abs=0.05)


def transfer_fraction(ranks: list[dict]) -> float:
    """The median over steps of: the communication of the rank that communicated least (the
    last to arrive at the collective: its communication is the transfer itself) over the
    step's time (its slowest rank). On a busy machine the ranks drift apart at random and
    waiting counts as communication, and a thread may stall for a while in any step; this
    takes both out, to see the message size alone."""
    return statistics.median(min(r["step_comm_s"][s] for r in ranks) / max(r["step_times_s"][s] for r in ranks)
                             for s in range(len(ranks[0]["step_times_s"])))


def test_with_fixed_compute_the_fraction_rises_with_message_size(measured):
    transfer = [transfer_fraction(measured[f"size{n}"]) for n in SIZES]
    assert 0 < transfer[0] < transfer[1] < transfer[2], transfer
    reported = [statistics.fmean(r["comm_fraction"] for r in measured[f"size{n}"]) for n in SIZES]
    assert reported[0] < reported[2] and reported[2] > 0.5, reported


def test_waiting_for_a_late_rank_counts_as_the_others_communication(measured):
    punctual, late = measured["punctual"], measured["late"]
    # rank 0 waits for the sleeping rank 1 inside its collective, every step
    assert late[0]["comm_s"] - punctual[0]["comm_s"] > 0.6 * STEPS * SLEEP_S, (punctual[0], late[0])
    # the sleeper itself arrives last and hardly waits
    assert late[1]["comm_s"] < 0.5 * STEPS * SLEEP_S, late[1]


def test_gloo_event_names_are_those_documented(measured):
    # torch 2.13: collectives as gloo:<name> on gloo's threads (reduce-scatter runs as an
    # all-reduce), point-to-point as gloo:send / gloo:recv (README "Metrics")
    expected = ["gloo:all_gather", "gloo:all_reduce", "gloo:all_to_all", "gloo:barrier", "gloo:broadcast",
                "gloo:recv", "gloo:send"]
    for rank in measured["every_collective"]:
        assert rank["comm_events"] == expected
        assert rank["comm_fraction"] > 0


def test_a_receive_waiting_for_a_late_sender_is_communication(measured):
    receiver, sender = measured["late_sender"]
    assert receiver["comm_s"] > 0.6 * STEPS * SLEEP_S, receiver
    assert sender["comm_s"] < 0.5 * STEPS * SLEEP_S, sender


def test_communication_hidden_behind_compute_is_not_exposed(measured):
    # rank 0 starts its all-reduce, then computes while it waits for rank 1
    hidden = measured["overlapped"][0]
    assert hidden["comm_s"] > 0.5 * STEPS * LATE_S, hidden
    # exposed: only if the thread is descheduled between starting the collective and the matmul
    assert hidden["exposed_comm_s"] < 0.5 * hidden["comm_s"], hidden
    for r in measured["sequential"]:  # the same work, communicating after computing
        assert r["comm_s"] > 0 and r["exposed_comm_s"] == pytest.approx(r["comm_s"], rel=0.05)


def test_a_known_extra_tensor_raises_the_peak_by_its_size(measured):
    for base, extra, resident in zip(measured["allocate"], measured["allocate_extra"], measured["allocate_resident"]):
        assert extra["peak_mem_bytes"] - base["peak_mem_bytes"] == pytest.approx(EXTRA, rel=0.05)
        # a tensor alive across the steps counts too, found before the window opens
        assert resident["peak_mem_bytes"] - base["peak_mem_bytes"] == pytest.approx(RESIDENT, rel=0.05)
        assert resident["resident_mem_bytes"] - base["resident_mem_bytes"] == pytest.approx(RESIDENT, rel=0.05)
        # the step's own temporaries: x and y, 4 MiB each, alive together
        assert base["peak_mem_bytes"] - base["resident_mem_bytes"] == pytest.approx(8 << 20, rel=0.05)
        assert base["memory_source"] == "allocator" and len(base["step_peak_mem_bytes"]) == STEPS


def test_a_tensor_freed_on_another_thread_is_freed_for_the_peak(measured):
    """The profiler records no event for a free on a thread it does not trace (gloo's worker
    dropping a finished collective's buffer); the allocator's total still falls, so the
    second 4 MiB tensor does not stack on the first."""
    for r in measured["freed_elsewhere"]:
        assert r["peak_mem_bytes"] - r["resident_mem_bytes"] == pytest.approx(4 << 20, rel=0.05)
        assert len(set(r["step_peak_mem_bytes"])) == 1  # and it does not grow from step to step


# -- the columnar reading gives the per-event reading's figures ----------------------------------

def test_columns_give_the_per_event_readings_figures_on_one_real_profile():
    """Every figure of the table-and-numpy reading equals the per-event one it replaced
    (tests/support/profile_reference.py) on the same profiles: data parallel, zero=3 (whose
    all-gathers allocate gloo scratch inside `c10d::` operators) and tensor parallel with SP
    (DTensor redistributions), on two gloo ranks."""
    from support.profile_reference import both_readings
    from support.spawn_group import run_on_ranks

    # 2 to 4 micro-batches a step: the per-event reading takes seconds per 10^5 events
    ranks = run_on_ranks(2, both_readings, ["dp=2,zero=0,mbs=4", "dp=2,zero=3,mbs=4", "tp=2,sp=1,mbs=4"])
    for rank in ranks:
        for layout, reading in zip(("dp=2 zero=0", "zero=3", "tp=2 sp"), rank):
            columns, per_event = reading["columns"], reading["per_event"]
            for name, value in columns.items():
                assert value == per_event[name], (layout, name, value, per_event[name])
        assert rank[1]["per_event"]["scratch_events"] > 0  # zero=3's scratch was there to find
        assert all(reading["columns"]["comm_s"] > 0 for reading in rank)
