"""One optimizer step over a rank's micro-batches.

    global batch = mbs * grad_accum * dp

Each micro-batch's loss is its token mean divided by grad_accum, so that the gradients
summed over micro-batches and averaged over data-parallel ranks (FSDP averages) are
those of the mean over the whole global batch, whatever the split. The data
parallel (parallel/dp.py) says when gradients are reduced: zero 0/1 once, overlapping the
last micro-batch's backward; zero 2/3 (FSDP2) every micro-batch, keeping only the shard.

Context parallel cuts each sequence over the cp ranks: the trainer is handed whole
sequences and a `shard_batch` hook gives it this rank's tokens and labels (the
head-tail shard, runtime/parallel/cp.py) before the forward.

Gradient clipping (a trial's `max_grad_norm`, off by default) scales every gradient by
min(1, max_norm / norm), norm being the global L2 norm of all the model's gradients:
each shard's part is summed by DTensor over the tensor- and data-parallel shards, and
the pipeline trainer adds the other stages' parts over the pipeline group. Every layout
therefore clips exactly as one process would.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autotune.runtime.moe import end_step, set_aux_loss_scale
from autotune_kernels.loss import cross_entropy as kernel_cross_entropy


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The micro-batch's mean token loss; vocabulary-sharded logits under tensor parallel
    (autotune_kernels.loss: no fp32 copy of the logits, one micro-batch's held)."""
    return kernel_cross_entropy(logits, labels)


def grad_norm(parameters: list[nn.Parameter], pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm of the gradients of `parameters` (this rank's, of every stage it
    runs), the same on every rank.

    Parameters are grouped by the mesh their DTensor gradient lives on (under FSDP with
    TP the norms' weights are sharded over data parallel only, the rest over both; a
    DTensor op takes one mesh): each group's norm is a DTensor reduced over its shards
    by `full_tensor`. The squares are summed, then over the pipeline stages."""
    by_mesh = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            by_mesh[param.grad.device_mesh if isinstance(param.grad, DTensor) else None].append(param.grad)
    square = torch.zeros((), device=next(iter(parameters)).device)
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
    if pipeline_group is not None:
        dist.all_reduce(square, group=pipeline_group)
    return square.sqrt()


def clip(dp, max_norm: float | None, pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """Scale every gradient by min(1, max_norm / norm), norm being the whole model's
    (torch's clip_grad_norm_ rule); returns that norm, None without clipping."""
    if max_norm is None:
        return None
    norm = dp.grad_norm(pipeline_group)
    dp.scale_gradients(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class Trainer:
    """Forward, backward and optimizer step of a model that is not pipelined. `dp` is its
    data parallel (parallel/dp.py): it reduces the gradients and owns the optimizer."""

    def __init__(self, model: nn.Module, dp, shard_batch=None, max_grad_norm: float | None = None,
                 loss_scaler=None):
        self.model = model
        self.dp = dp
        self.optimizer = dp.optimizer
        self.shard_batch = shard_batch  # (inputs, labels) -> this rank's part, under context parallel
        self.max_grad_norm = max_grad_norm
        self.loss_scaler = loss_scaler  # fp16: runtime/precision.LossScaler

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Train on this rank's micro-batches; returns the rank's share of the loss,
        MoE balance losses included."""
        total = torch.zeros((), device=batches[0][0].device)
        set_aux_loss_scale(self.model, 1 / len(batches))  # MoE balance losses scale as the loss does
        for i, (inputs, labels) in enumerate(batches):
            if self.shard_batch is not None:
                inputs, labels = self.shard_batch(inputs, labels)
            self.dp.before_microbatch(last=i == len(batches) - 1)
            loss = cross_entropy(self.model(inputs), labels) / len(batches)
            (loss if self.loss_scaler is None else loss * self.loss_scaler.scale).backward()
            total += loss.detach()
        total += end_step(self.model, total.device)
        self.dp.finish_backward()
        if self.loss_scaler is not None and not self.loss_scaler.unscale_and_check(self.dp):
            self.dp.discard_gradients()  # an overflow: skip this step, at a halved scale
            return total
        clip(self.dp, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total
