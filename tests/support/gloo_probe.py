"""Probes of gloo's hold on a collective's buffers (runtime/parallel/gloo_release.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotune.runtime.parallel.gloo_release import ReleasedAllGather
from autotune.runtime.torch_compat import storage_references


def references_after_all_gathers(calls: int, elements: int) -> dict:
    """Each of `calls` all-gathers through ReleasedAllGather and through torch's own call:
    how many returned with the output still referenced by more than the caller, and
    whether every gathered output is right. "held" is the control: a released call after
    which the caller keeps a second view of the output, which the count must see every time."""
    world, rank = dist.get_world_size(), dist.get_rank()
    late = {"released": 0, "torch": 0, "held": 0}
    right = True
    for i in range(calls):
        for kind in late:
            output = torch.empty(world * elements)
            shard = output.narrow(0, rank * elements, elements)  # FSDP gathers in place
            shard.fill_(rank + i)
            before = storage_references(output)
            held = None
            if kind in ("released", "held"):
                ReleasedAllGather()(output, shard, dist.group.WORLD)
                held = output.view(-1) if kind == "held" else None
            else:
                dist.all_gather_into_tensor(output, shard, async_op=True).wait()
            late[kind] += storage_references(output) > before
            expected = torch.arange(world, dtype=torch.float32).repeat_interleave(elements) + i
            right &= bool(torch.equal(output, expected))
            del shard, held
    return {"late": late, "right": right}
