"""ZeRO-1: the optimizer state is sharded over the data-parallel ranks; parameters and
gradients are not.

torch has no ZeRO-1 that composes with FSDP2 and DTensor tensor parallel
(`ZeroRedundancyOptimizer` assigns whole parameters to ranks and expects plain DDP
tensors), so it is built here, small:

- The model is wrapped exactly as for zero=0 (FSDP2's replicate: full parameters on
  every rank, gradients all-reduced once per optimizer step).
- The optimizer is a plain AdamW over *slices*: every parameter's (tensor-parallel
  local) storage, flattened, is cut into N chunks of ceil(numel / N) elements (the
  last ones may be short or empty), and this rank's slice is its chunk. AdamW's two
  moments therefore take 8 / N bytes per parameter instead of 8.
- A step pre-hook points each slice at this rank's chunk of its parameter and the
  slice's gradient at the same chunk of the all-reduced gradient, and drops the full
  gradient. AdamW then updates this rank's chunk of every parameter in place.
- A step post-hook all-gathers the chunks, a bucket of parameters per collective, so
  every rank again holds the full updated parameters for the next forward.

AdamW is element-wise, so every element is updated by exactly the arithmetic zero=0
applies to it: the two agree to the last bit up to the grouping of AdamW's kernels.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

BUCKET_ELEMENTS = 1 << 24  # elements all-gathered per collective: 64 MiB of fp32 across the group


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a (possibly DTensor) parameter or gradient."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class SlicedParameters:
    """This rank's slices of `params` over `mesh`, and the hooks that keep them in step."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh):
        self.params = params
        self.group = mesh.get_group()
        self.ranks, self.rank = mesh.size(), mesh.get_local_rank()
        self.chunks = [math.ceil(local(p).numel() / self.ranks) for p in params]
        with torch.no_grad():
            self.slices = [nn.Parameter(self.my_chunk(i)) for i in range(len(params))]
        self.buckets = self.make_buckets()

    def my_part(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of `flat`, parameter i's flattened storage or gradient (a view)."""
        start = min(self.rank * self.chunks[i], flat.numel())
        return flat[start:min(start + self.chunks[i], flat.numel())]

    def my_chunk(self, i: int) -> torch.Tensor:
        """A view of this rank's chunk of parameter i: writing it writes the parameter."""
        return self.my_part(i, local(self.params[i]).detach().view(-1))

    def make_buckets(self) -> list[list[int]]:
        buckets, current, size = [], [], 0
        for i, chunk in enumerate(self.chunks):
            if current and size + chunk * self.ranks > BUCKET_ELEMENTS:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += chunk * self.ranks
        return buckets + [current] if current else buckets

    @torch.no_grad()
    def before_step(self, optimizer, args, kwargs) -> None:
        # FSDP may re-allocate a parameter's storage (lazy init after to_empty), so the
        # slices are re-pointed every step rather than trusted from construction.
        for i, (param, piece) in enumerate(zip(self.params, self.slices)):
            piece.data = self.my_chunk(i)
            if param.grad is None:
                piece.grad = None
                continue
            piece.grad = self.my_part(i, local(param.grad).reshape(-1))
            param.grad = None

    @torch.no_grad()
    def after_step(self, optimizer, args, kwargs) -> None:
        for bucket in self.buckets:
            width = sum(self.chunks[i] for i in bucket)
            mine = torch.zeros(width, dtype=self.slices[bucket[0]].dtype, device=self.slices[bucket[0]].device)
            offset = 0
            for i in bucket:
                mine[offset:offset + self.slices[i].numel()] = self.slices[i]
                offset += self.chunks[i]
            everyone = mine.new_empty(self.ranks * width)
            dist.all_gather_single(everyone, mine, group=self.group)
            everyone = everyone.view(self.ranks, width)
            offset = 0
            for i in bucket:
                flat = local(self.params[i]).detach().view(-1)
                flat.copy_(everyone[:, offset:offset + self.chunks[i]].reshape(-1)[:flat.numel()])
                offset += self.chunks[i]


def zero_one_adamw(groups: list[tuple[list[nn.Parameter], DeviceMesh]], **adamw_options) -> torch.optim.AdamW:
    """A torch AdamW whose state covers only this rank's slices of each group's
    parameters over the group's mesh (dense parameters and expert-parallel experts are
    replicated over different ranks, so they are sliced over different meshes)."""
    sliced = [SlicedParameters(params, mesh) for params, mesh in groups]
    optimizer = torch.optim.AdamW([piece for s in sliced for piece in s.slices], **adamw_options)
    for s in sliced:
        optimizer.register_step_pre_hook(s.before_step)
        optimizer.register_step_post_hook(s.after_step)
    return optimizer
