"""The tests' warm gloo ranks (support/spawn_group.py): kept from call to call, and replaced
by fresh ones after a rank raises or dies, with what went wrong in the error."""

import os

import pytest
import torch.distributed as dist

from support.spawn_group import call_on_ranks


def rank_and_pid() -> list[int]:
    return [dist.get_rank(), os.getpid()]


def fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one fails")
    dist.barrier()  # rank 0 waits for a rank that will never come
    return 0


def die_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()
    return 0


def test_warm_ranks_are_kept_and_a_rank_that_raises_or_dies_leaves_fresh_ones():
    first = call_on_ranks(2, rank_and_pid, ())
    assert call_on_ranks(2, rank_and_pid, ()) == first and [rank for rank, _ in first] == [0, 1]
    with pytest.raises(RuntimeError, match=r"rank 1 raised:(.|\n)*ValueError: rank one fails"):
        call_on_ranks(2, fail_on_rank_one, ())
    replaced = call_on_ranks(2, rank_and_pid, ())
    assert {pid for _, pid in replaced}.isdisjoint(pid for _, pid in first)
    # gloo tells rank 0 its peer is gone (and the error names rank 1's death beside it), or
    # rank 0 waits and rank 1 is seen dead
    with pytest.raises(RuntimeError, match=r"^(rank 0 raised:(.|\n)*rank 1 died \(exit code 3\)$"
                                           r"|ranks \[1\] gave no answer \(died\)$)"):
        call_on_ranks(2, die_on_rank_one, ())
    again = call_on_ranks(2, rank_and_pid, ())
    assert {pid for _, pid in again}.isdisjoint(pid for _, pid in replaced)
