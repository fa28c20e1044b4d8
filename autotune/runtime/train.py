"""One optimizer step over a rank's micro-batches.

    global batch = mbs * grad_accum * dp

Each micro-batch's loss is its token mean divided by grad_accum, so that the gradients
summed over micro-batches and averaged over data-parallel ranks (FSDP averages) are
those of the mean over the whole global batch, whatever the split. Gradients are
synchronised on the last micro-batch only.

Context parallel cuts each sequence over the cp ranks: the trainer is handed whole
sequences and a `shard_batch` hook gives it this rank's tokens and labels (the
head-tail shard, runtime/parallel/cp.py) before the forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from autotune.runtime.moe import end_step, set_aux_loss_scale


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class Trainer:
    """Forward, backward and optimizer step of a model that is not pipelined."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_context=contextlib.nullcontext, shard_batch=None):
        self.model = model
        self.optimizer = optimizer
        self.loss_context = loss_context  # loss_parallel() under tensor parallel
        self.shard_batch = shard_batch  # (inputs, labels) -> this rank's part, under context parallel

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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total
