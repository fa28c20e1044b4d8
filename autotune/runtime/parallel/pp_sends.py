"""Free each pipeline send as soon as it has certainly arrived, as Megatron-LM does.

torch's lowered schedules (`_PipelineScheduleRuntime`: interleaved 1F1B, zero bubble,
ZB-V, DualPipeV) post every send and wait for them only when the step ends, so every
activation and gradient a rank sends stays alive for the whole step: micro-batches x
stages x a boundary tensor (14 to 187 GiB on published Megatron layouts). Asking a send
whether it is done does not work on gloo (its work reports completion only once
waited, and a second wait blocks), so the CPU and a GPU would disagree.

What works on both: a send has certainly arrived once its receiver has run the action
that consumed it, and this rank knows that as soon as it receives a message its peer
(or a chain of peers) sent after that action. The schedule's action lists say where
that is, the same on every run: `release_points` replays them with one vector clock per
rank. The rank then waits the send at that point (the wait returns at once) and drops
it, so the schedule's own wait at the end finds nothing left. A send no later message
vouches for waits at the end as before (the cooldown's last few).
"""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist

from autotune.runtime.torch_compat import PIPELINE_ACTIONS

Key = tuple[str, int, int]  # ("F" | "B", stage index, micro-batch): a send, or what consumes one


def consumed_send(kind: str, stage: int, microbatch: int, stage_rank: dict[int, int]) -> Key | None:
    """The send a compute action waits for from another rank: a forward the previous
    stage's activation, a (full or input) backward the next stage's gradient."""
    if kind == "F" and stage - 1 in stage_rank and stage_rank[stage - 1] != stage_rank[stage]:
        return ("F", stage - 1, microbatch)
    if kind == "B" and stage + 1 in stage_rank and stage_rank[stage + 1] != stage_rank[stage]:
        return ("B", stage + 1, microbatch)
    return None


def _flatten(actions) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of each action in order, overlapped pairs unfolded; kinds:
    F, B (full or input backward), SEND_F, SEND_B, or "-" for what neither sends nor consumes."""
    out = []
    for action in actions:
        if action is None:
            continue
        sub = getattr(action, "sub_actions", None)
        if sub:
            out.extend(_flatten(sub))
            continue
        kind = PIPELINE_ACTIONS.get(action.computation_type, "-")
        out.append((kind, action.stage_index, action.microbatch_index))
    return out


def release_points(orders: dict[int, list], stage_rank: dict[int, int]) -> dict[int, dict[Key, list[Key]]]:
    """{rank: {consuming action (kind, stage, micro-batch): the rank's own sends certainly
    delivered once that action has received its input}}, from every rank's action list.

    Replays the schedule (each rank runs until it needs a send not yet posted) keeping a
    vector clock per rank: clock[r][q] = how many of q's actions r knows are done. A send
    by r consumed at index j of q's list is delivered once clock[r][q] > j; that first
    happens at one of r's consuming actions, where r learns what its peer knew."""
    flat = {rank: _flatten(actions) for rank, actions in orders.items()}
    ranks = sorted(flat)
    clock = {rank: dict.fromkeys(ranks, 0) for rank in ranks}
    history: dict[int, list[dict[int, int]]] = {rank: [] for rank in ranks}
    posted: dict[Key, dict[int, int]] = {}  # send -> the sender's clock as it posted it
    consumer: dict[Key, tuple[int, int]] = {}  # send -> (receiving rank, index of the consuming action)
    position = dict.fromkeys(ranks, 0)
    while any(position[rank] < len(flat[rank]) for rank in ranks):
        moved = False
        for rank in ranks:
            while position[rank] < len(flat[rank]):
                kind, stage, microbatch = flat[rank][position[rank]]
                needed = consumed_send(kind, stage, microbatch, stage_rank) if kind in ("F", "B") else None
                if needed is not None:
                    if needed not in posted:
                        break
                    for peer, seen in posted[needed].items():
                        clock[rank][peer] = max(clock[rank][peer], seen)
                    consumer[needed] = (rank, position[rank])
                position[rank] += 1
                clock[rank][rank] = position[rank]
                if kind in ("SEND_F", "SEND_B"):
                    posted[(kind[-1], stage, microbatch)] = dict(clock[rank])
                history[rank].append(dict(clock[rank]))
                moved = True
        if not moved:
            raise RuntimeError("pipeline schedule replay is stuck: a rank waits for a send never posted")
    releases: dict[int, dict[Key, list[Key]]] = {rank: defaultdict(list) for rank in ranks}
    for rank in ranks:
        sent_at = {(k[-1], s, m): i for i, (k, s, m) in enumerate(flat[rank]) if k in ("SEND_F", "SEND_B")}
        for send, index in sent_at.items():
            if send not in consumer:
                continue
            peer, consumed_at = consumer[send]
            for later in range(index + 1, len(flat[rank])):
                kind, stage, microbatch = flat[rank][later]
                if kind in ("F", "B") and history[rank][later][peer] > consumed_at:
                    releases[rank][(kind, stage, microbatch)].append(send)
                    break
    return {rank: dict(found) for rank, found in releases.items()}


class SendReleaser:
    """One pipeline rank's sends under a lowered schedule, waited and dropped at their
    release points. The stages tell it what they send and consume; `capture` (set
    around the schedule's step) hands it the works torch's schedule posts."""

    def __init__(self, orders: dict[int, list], stage_rank: dict[int, int], rank: int):
        self.releases = release_points(orders, stage_rank).get(rank, {})
        self.pending: Key | None = None
        self.works: dict[Key, list[dist.Work]] = {}

    def sending(self, kind: str, stage: int, microbatch: int) -> None:
        """A stage is building the send ops of (kind, stage, micro-batch): the next works
        posted are that send's."""
        self.pending = (kind, stage, microbatch)

    def posted(self, ops: list[dist.P2POp], works: list[dist.Work]) -> None:
        """torch posted a batch: the pending send's, if it is all sends (a receive is never
        waited early)."""
        if self.pending is not None and ops and all(op.op is dist.isend for op in ops):
            self.works[self.pending] = works
        self.pending = None

    def consuming(self, kind: str, stage: int, microbatch: int) -> None:
        """A compute action has its input: wait and drop the sends it vouches for. The
        list torch keeps is emptied in place, so its own wait at the step's end skips them."""
        for send in self.releases.get((kind, stage, microbatch), ()):
            works = self.works.pop(send, None)
            if works:
                for work in works:
                    work.wait()
                works.clear()

    def end_step(self) -> None:
        self.works.clear()
        self.pending = None
