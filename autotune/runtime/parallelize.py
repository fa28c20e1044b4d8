"""Apply the layout's parallel dimensions to the plain model, in one documented order.

    meta-device model -> pipeline stages -> TP(+SP) -> EP -> CP -> activation checkpointing
    -> FSDP / replicate -> to_empty -> deterministic init

(torchtitan's order: TP changes parameter shapes before FSDP shards them; CP swaps
the attention core before recompute wraps it; checkpoint wrappers go inside FSDP so
that FSDP's hooks see whole blocks.) Pipeline parallel splits the model into stages
first and runs `parallelize_stage` on each; expert and context parallel slot in at
their marked places.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import loss_parallel

from autotune.config import ModelConfig
from autotune.layout import Layout
from autotune.runtime.init import init_weights
from autotune.runtime.mesh import Meshes
from autotune.runtime.model import Transformer
from autotune.runtime.parallel.cp import HeadTailSharder, apply_context_parallel
from autotune.runtime.parallel.dp import apply_data_parallel, build_optimizer, mixed_precision_policy
from autotune.runtime.parallel.ep import apply_expert_parallel
from autotune.runtime.parallel.recompute import apply_recompute
from autotune.runtime.parallel.tp import apply_tensor_parallel
from autotune.runtime.train import Trainer
from autotune.trialspec import TrialSpec


def parallelize_stage(stage: nn.Module, layout: Layout, mesh: Meshes,
                      mp_policy: MixedPrecisionPolicy | None) -> None:
    """Every dimension but PP, applied in place to one (meta-device) model or stage.
    mp_policy: None for fp32, else FSDP2's mixed precision (see dp.mixed_precision_policy)."""
    if layout.tp > 1:
        apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=bool(layout.sp))
    if layout.ep > 1:
        apply_expert_parallel(stage, mesh["ep"])
    if layout.cp > 1:
        apply_context_parallel(stage, mesh["cp"], stage.cfg.seq_len)
    apply_recompute(stage, layout.recompute)
    apply_data_parallel(stage, mesh, layout, mp_policy)


def build_model(cfg: ModelConfig, layout: Layout, mesh: Meshes, device: torch.device,
                seed: int) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize_stage(model, layout, mesh, mixed_precision_policy(cfg, device))
    model.to_empty(device=device)
    init_weights(model, seed, cfg.hidden_size, cfg.num_layers)
    return model


def build_trainer(cfg: ModelConfig, layout: Layout, mesh: Meshes, device: torch.device,
                  spec: TrialSpec) -> Trainer:
    """The parallelised model with its optimizer, ready to train on micro-batches."""
    model = build_model(cfg, layout, mesh, device, spec.seed)
    optimizer = build_optimizer(model, mesh, layout, lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    # Under TP the logits stay vocab-sharded and the loss is computed on the shards.
    return Trainer(model, optimizer, loss_context=loss_parallel if layout.tp > 1 else contextlib.nullcontext,
                   shard_batch=HeadTailSharder(mesh["cp"]) if layout.cp > 1 else None)
