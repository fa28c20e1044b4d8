"""Every pipeline schedule the tool runs, and every fact about it, in one table.

Pure Python: the layout rules, the stage split, the runtime (which builds torch's
class by its name), the estimator (micro-batches in flight, the bubble, the peaks of
the split backwards), the report and the exports all read `SCHEDULES`; adding a
schedule is adding a row here. The formulas are torch.distributed.pipelining's
(2.13), counted from its action lists (tests/test_memory_pp.py compares them).

Placement of a rank's stages (stage_split.rank_stage_ids):
    single   one stage per rank (vpp = 1)
    looped   vpp stages per rank: rank, rank + pp, rank + 2 pp, ...
    v        two stages per rank in a V: rank and 2 pp - 1 - rank (vpp = 2)

Notation below: pp pipeline ranks, m micro-batches per step (grad_accum), v stages per
rank, r = m // max(1, m // pp) the micro-batches of one round of the looped schedules;
F, B, W one chunk's forward, input-gradient and weight-gradient times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# The layout's `schedule` values: the keys of SCHEDULES (tests/test_structure.py keeps them equal).
ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"]


def _round(pp: int, m: int) -> int:
    """Micro-batches per round of the looped schedules: m // max(1, m // pp)."""
    return m // max(1, m // pp)


def _whole_rounds(pp: int, m: int) -> str | None:
    rounds = max(1, m // pp)
    if m % rounds:
        return (f"runs micro-batches in rounds of pp, so grad_accum must be a multiple of "
                f"max(1, grad_accum // pp) = {rounds}")
    return None


def _at_least(factor: int, what: str, why: str = "") -> Callable[[int, int], str | None]:
    def rule(pp: int, m: int) -> str | None:
        if m < factor * pp:
            return f"needs at least {what} ({factor * pp}) micro-batches per step{why}"
        return None
    return rule


def _any(pp: int, m: int) -> str | None:
    return None


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule.

    in_flight(pp, m, v, rank): the most (stage, micro-batch) forward results a rank
      holds at once (a forward adds one; the backward that frees it, for split
      backwards the weight step, removes it).
    bubble(f, b, w): idle time per chunk and pipeline hop; a rank idles (pp - 1) times it.
    postponed(pp, m, v, rank, in_flight): the (chunks in flight, postponed weight steps)
      pairs at which a rank of a split-backward schedule can peak (the Pareto front of
      the two counts over its action list); a postponed weight step is a (stage,
      micro-batch), not of the first stage, whose input step ran and weight step not.
    microbatch_rule(pp, m): why torch's constructor refuses m micro-batches, or None.
    gradients_held(pp, rank): for a lowered schedule, the most input gradients a rank has
      sent and not yet freed: the runtime frees a send once a later message proves it
      arrived (runtime/parallel/pp_sends.py), which for a gradient sent backward comes a
      few actions later. Counted from torch's action lists at m >= pp
      (tests/test_pipeline_sends.py); the activations a rank sends are its stage outputs,
      freed with them at their backward.
    sends_kept(pp, m, rank, chunks): for a schedule torch runs unlowered, the sends whose
      tensors its step function still references (the works or ops it keeps in locals)
      at a backward after the rank's first, with `chunks` in flight: (outputs besides those
      in flight, gradients sent backward). GPipe waits every send at the end of its
      forwards and of its backwards and keeps the works till then; 1F1B keeps the works of
      the warm-up's last fired send through the steady phase, and the ops of the last
      backward's send until the next backward has run.
    """

    name: ScheduleName
    torch_class: str  # in torch.distributed.pipelining.schedules
    torchtitan: str  # torchtitan's pipeline schedule name
    megatron: str  # the schedule Megatron-LM runs for it (it has 1F1B and interleaved 1F1B)
    placement: str  # single | looped | v
    split_backward: bool  # the backward is an input step and a later weight step
    lowered: bool  # torch runs it on its lowered runtime, which waits for its sends when the step ends
    # (the runtime waits them earlier: gradients_held)
    in_flight: Callable[[int, int, int, int], int]
    bubble: Callable[[float, float, float], float]
    microbatch_rule: Callable[[int, int], str | None] = _any
    postponed: Callable[[int, int, int, int, int], list[tuple[int, int]]] | None = None
    gradients_held: Callable[[int, int], int] | None = None
    sends_kept: Callable[[int, int, int, int], tuple[int, int]] = lambda pp, m, rank, chunks: (0, 0)

    @property
    def v_shape(self) -> bool:
        return self.placement == "v"

    @property
    def multi_stage(self) -> bool:
        """Several stages per rank: torch's PipelineScheduleMulti, built from a list of stages."""
        return self.placement != "single"

    @property
    def megatron_exact(self) -> bool:
        return self.megatron == self.name

    def vpp_error(self, vpp: int) -> str | None:
        """Why this schedule cannot run `vpp` stages per rank, or None."""
        if self.placement == "single" and vpp != 1:
            looped = " or ".join(s.name for s in SCHEDULES.values() if s.placement == "looped")
            return f"runs one stage per rank, so vpp must be 1 (use {looped} for vpp > 1)"
        if self.placement == "v" and vpp != 2:
            return "runs two stages per rank, so vpp must be 2"
        return None

    @property
    def vpp_choices(self) -> tuple[int, ...]:
        """The virtual stages a search of every layout tries with this schedule."""
        return {"single": (1,), "looped": (2, 4), "v": (2,)}[self.placement]

    @property
    def default_vpp(self) -> int:
        return 2 if self.placement == "v" else 1

    def peak_points(self, pp: int, m: int, v: int, rank: int) -> list[tuple[int, int]]:
        """(chunks in flight, postponed weight steps) at each moment a rank can peak."""
        chunks = self.in_flight(pp, m, v, rank)
        if self.postponed is None:
            return [(chunks, 0)]
        return self.postponed(pp, m, v, rank, chunks)


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    # All forwards, then all backwards: every micro-batch in flight.
    Schedule("gpipe", "ScheduleGPipe", "GPipe", "1f1b", "single", False, False,
             in_flight=lambda pp, m, v, rank: m,
             bubble=lambda f, b, w: f + b + w,
             sends_kept=lambda pp, m, rank, chunks: (m - chunks, m - chunks)),
    Schedule("1f1b", "Schedule1F1B", "1F1B", "1f1b", "single", False, False,
             in_flight=lambda pp, m, v, rank: min(pp - rank, m),
             bubble=lambda f, b, w: f + b + w,
             microbatch_rule=_at_least(1, "pp"),
             sends_kept=lambda pp, m, rank, chunks: (int(min(m, pp - rank) >= 2), 1)),
    Schedule("interleaved_1f1b", "ScheduleInterleaved1F1B", "Interleaved1F1B", "interleaved_1f1b", "looped",
             False, True,
             in_flight=lambda pp, m, v, rank: min((v - 1) * _round(pp, m) + 2 * (pp - 1 - rank) + 1, m * v),
             bubble=lambda f, b, w: f + b + w,  # per chunk: (p-1)/(v*m+p-1) of the step
             microbatch_rule=_whole_rounds,
             gradients_held=lambda pp, rank: pp if rank == 0 else max(pp, 2 * (pp - rank) + 1)),
    # ZB-H1 interleaved: the weight steps lag, so every rank holds as many chunks.
    Schedule("zero_bubble", "ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", "interleaved_1f1b",
             "looped", True, True,
             in_flight=lambda pp, m, v, rank: min((v - 1) * _round(pp, m) + pp, m * v),
             bubble=lambda f, b, w: f + b - w,
             microbatch_rule=_whole_rounds,
             postponed=lambda pp, m, v, rank, chunks: [(chunks, min(rank + 1, m * v))],  # defers by its rank
             gradients_held=lambda pp, rank: pp),
    # ZB-V. With pp < m < 2 pp - 1 it also passes (2, 2) or (3, 3), never the heavier moment.
    Schedule("zbv", "ScheduleZBVZeroBubble", "ZBVZeroBubble", "interleaved_1f1b", "v", True, True,
             in_flight=lambda pp, m, v, rank: min(2 * pp, m + 1 + rank, 2 * m),
             bubble=lambda f, b, w: f + b - 2 * w,
             postponed=lambda pp, m, v, rank, chunks: [(chunks, 1)] + (
                 [(pp + rank, 2 * rank + 1)] if m >= 2 * pp - 1 and rank else []),
             gradients_held=lambda pp, rank: 2 if rank == 0 else pp - rank + 1),
    # DualPipeV's F&B overlaps a forward with a backward to hide communication, not
    # compute, so it costs F + B_full: (pp-1)(F&B + B_full - 3W) = (pp-1)(F + 2B - W).
    Schedule("dualpipev", "ScheduleDualPipeV", "DualPipeV", "interleaved_1f1b", "v", True, True,
             in_flight=lambda pp, m, v, rank: min(2 * pp + 1, 2 * m),
             bubble=lambda f, b, w: f + 2 * b - w,
             microbatch_rule=_at_least(2, "2*pp", " (one per stage)"),
             postponed=lambda pp, m, v, rank, chunks: [(2 * pp + 1, 0), (2 * pp, 1)] + (
                 [(pp, rank + 1)] if rank else []),
             gradients_held=lambda pp, rank: 2 if rank == 0 else pp - rank + 1),
)}
DEFAULT_SCHEDULE: ScheduleName = "1f1b"
