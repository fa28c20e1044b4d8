"""One optimizer step over a rank's micro-batches.

    global batch = mbs * grad_accum * dp

Each micro-batch's loss is its token mean divided by grad_accum, so that the gradients
summed over micro-batches and averaged over data-parallel ranks (FSDP averages) are
those of the mean over the whole global batch, whatever the split. Gradients are
synchronised on the last micro-batch only.

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

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from autotune.runtime.moe import end_step, set_aux_loss_scale


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float,
                   pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the gradients of `parameters` (this rank's, of every stage it runs) to a global
    L2 norm of `max_norm`; returns that norm before clipping.

    Parameters are grouped by the mesh their DTensor gradient lives on (under FSDP with
    TP the norms' weights are sharded over data parallel only, the rest over both; a
    DTensor op takes one mesh): each group's norm is a DTensor reduced over its shards
    by `full_tensor`. The squares are summed, then over the pipeline stages, so every
    rank scales by the same factor, group by group."""
    by_mesh = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            by_mesh[param.grad.device_mesh if isinstance(param.grad, DTensor) else None].append(param)
    square = torch.zeros((), device=next(iter(parameters)).device)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
    if pipeline_group is not None:
        dist.all_reduce(square, group=pipeline_group)
    norm = square.sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


class Trainer:
    """Forward, backward and optimizer step of a model that is not pipelined."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_context=contextlib.nullcontext, shard_batch=None, max_grad_norm: float | None = None):
        self.model = model
        self.optimizer = optimizer
        self.loss_context = loss_context  # loss_parallel() under tensor parallel
        self.shard_batch = shard_batch  # (inputs, labels) -> this rank's part, under context parallel
        self.max_grad_norm = max_grad_norm

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Train on this rank's micro-batches; returns the rank's share of the loss,
        MoE balance losses included."""
        total = torch.zeros((), device=batches[0][0].device)
        set_aux_loss_scale(self.model, 1 / len(batches))  # MoE balance losses scale as the loss does
        for i, (inputs, labels) in enumerate(batches):
            if self.shard_batch is not None:
                inputs, labels = self.shard_batch(inputs, labels)
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            with self.loss_context():
                loss = cross_entropy(self.model(inputs), labels) / len(batches)
                loss.backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        total += end_step(self.model, total.device)
        if self.max_grad_norm is not None:
            clip_grad_norm(list(self.model.parameters()), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total
