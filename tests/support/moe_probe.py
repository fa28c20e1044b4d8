"""Rank functions (for spawn_group.run_on_ranks) for the MoE and expert-parallel tests:
a trial with the router biased towards one expert, and the balance loss of sequences
split over ranks as context parallel splits them."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from autotune.config import load_model
from autotune.runtime import moe
from autotune.runtime.trial import run
from autotune.trialspec import TrialSpec


def skewed_trials(layouts: list[str], bias: float) -> list[dict]:
    """Trial results of tiny-moe per layout, its router's logit of expert 0 raised by `bias`."""
    original = moe.route

    def biased(logits: torch.Tensor, top_k: int):
        return original(logits + bias * (torch.arange(logits.shape[-1], device=logits.device) == 0), top_k)

    model = dataclasses.asdict(load_model("tiny-moe"))
    moe.route = biased
    try:
        return [run(TrialSpec(model=model, layout=layout, steps=2, warmup=1)) for layout in layouts]
    finally:
        moe.route = original


def split_sequence_balance_loss(batch: int = 3, seq: int = 16, experts: int = 8) -> dict:
    """Each rank holds head-tail chunks of the same sequences (as context parallel cuts
    them); the mean over ranks of balance_loss with the sequence group must be the loss
    of the whole sequences, and each rank's gradient its tokens' share of the whole's."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    probabilities = torch.randn(batch, seq, experts, generator=torch.Generator().manual_seed(0)).softmax(-1)
    chosen = probabilities.topk(2).indices
    whole = probabilities.clone().requires_grad_()
    whole_loss = moe.balance_loss(whole, chosen, experts)
    whole_loss.backward()
    mine = torch.arange(seq).view(2 * ranks, -1)[[rank, 2 * ranks - 1 - rank]].flatten()
    part = probabilities[:, mine].clone().requires_grad_()
    loss = moe.balance_loss(part, chosen[:, mine], experts, dist.group.WORLD)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return {"loss_error": abs(mean.item() / ranks - whole_loss.item()),
            "gradient_error": (part.grad / ranks - whole.grad[:, mine]).abs().max().item(),
            "loss": whole_loss.item()}


def skew_and_split(skewed_layouts: list[str], bias: float) -> dict:
    """Both in one process group: skewed trials, the split-sequence balance loss."""
    return {"skewed": skewed_trials(skewed_layouts, bias), "split": split_sequence_balance_loss()}
