"""Lowered pipeline schedules free each send once a later message proves it arrived
(runtime/parallel/pp_sends.py): the release points follow from torch's action lists,
and the gradients a rank holds sent match the schedules table the estimator reads."""

import pytest
from torch import nn
from torch.distributed.pipelining import schedules

from autotune.plan.layout import Layout
from autotune.plan.schedules import SCHEDULES
from autotune.plan.stage_split import rank_stage_ids
from autotune.runtime.parallel.pp_sends import _flatten, release_points

LOWERED = [name for name, schedule in SCHEDULES.items() if schedule.lowered]


class ActionListStage:
    """What torch's schedule constructors read of a stage to lay out its actions; no model runs."""

    def __init__(self, index: int, stages: int, pp: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.has_backward, self.submod, self.stage_index_to_group_rank = True, nn.Linear(1, 1), {}
        self.scale_grads, self.dw_builder = False, None


def action_lists(name: str, pp: int, m: int, vpp: int = 2):
    layout = Layout(pp=pp, schedule=name, vpp=vpp)  # every lowered schedule places two stages per rank or more
    stages = [ActionListStage(s, pp * layout.vpp, pp) for s in rank_stage_ids(layout, 0)]
    built = getattr(schedules, SCHEDULES[name].torch_class)(stages, n_microbatches=m, loss_fn=lambda out, y: out)
    return built.pipeline_order_with_comms, built.stage_index_to_group_rank


def most_gradients_held(orders, stage_rank) -> dict[int, int]:
    releases = release_points(orders, stage_rank)
    most = {}
    for rank, actions in orders.items():
        live, most[rank] = set(), 0
        for kind, stage, microbatch in _flatten(actions):
            for send in releases[rank].get((kind, stage, microbatch), ()) if kind in ("F", "B") else ():
                live.discard(send)
            if kind == "SEND_B":
                live.add(("B", stage, microbatch))
            most[rank] = max(most[rank], len(live))
    return most


@pytest.mark.parametrize("name", LOWERED)
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_gradients_held_match_the_schedules_table(name, pp):
    """Without early release a rank would hold every gradient it sends: m per stage fed
    across (64 at pp 8, m 32, two stages). With it, a bounded few, as the table says."""
    for m, vpp in ((2 * pp, 2), (4 * pp, 2), (4 * pp, 4 if SCHEDULES[name].placement == "looped" else 2)):
        held = most_gradients_held(*action_lists(name, pp, m, vpp))
        for rank, count in held.items():
            assert count == SCHEDULES[name].gradients_held(pp, rank), (name, pp, m, rank)
            assert count <= 2 * pp + 1


@pytest.mark.parametrize("name", LOWERED)
def test_a_send_is_released_only_after_its_receiver_consumed_it(name):
    """Replay every rank in lock step, one action each per round where it can run, and check
    at each release that the consumer of the released send has already run."""
    orders, stage_rank = action_lists(name, 4, 8)
    releases = release_points(orders, stage_rank)
    flat = {rank: _flatten(actions) for rank, actions in orders.items()}
    done = {rank: 0 for rank in flat}
    consumed: set = set()
    posted: set = set()
    while any(done[r] < len(flat[r]) for r in flat):
        moved = False
        for rank in flat:
            if done[rank] == len(flat[rank]):
                continue
            kind, stage, microbatch = flat[rank][done[rank]]
            needs = None
            if kind == "F" and stage > 0 and stage_rank[stage - 1] != rank:
                needs = ("F", stage - 1, microbatch)
            if kind == "B" and stage + 1 in stage_rank and stage_rank[stage + 1] != rank:
                needs = ("B", stage + 1, microbatch)
            if needs and needs not in posted:
                continue
            if needs:
                consumed.add(needs)
            for send in releases[rank].get((kind, stage, microbatch), ()) if kind in ("F", "B") else ():
                assert send in consumed, (name, rank, send)
            if kind in ("SEND_F", "SEND_B"):
                posted.add((kind[-1], stage, microbatch))
            done[rank] += 1
            moved = True
        assert moved
    released = sum(len(sends) for per_rank in releases.values() for sends in per_rank.values())
    assert released >= len(posted) // 2  # most sends go early; the cooldown's last wait for the step's end
