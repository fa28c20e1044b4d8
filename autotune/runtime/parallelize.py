"""Apply the layout's parallel dimensions to the plain model, in one documented order.

    meta-device model -> pipeline stages -> TP(+SP) -> EP -> CP -> activation checkpointing
    -> FSDP / replicate -> to_empty -> deterministic init

(torchtitan's order: TP changes parameter shapes before FSDP shards them; checkpoint
wrappers go inside FSDP so that FSDP's hooks see whole blocks.)
"""

from __future__ import annotations

import torch
from torch import nn
from autotune.runtime.mesh import Meshes

from autotune.config import ModelConfig
from autotune.layout import Layout
from autotune.runtime.init import init_weights
from autotune.runtime.model import Transformer
from autotune.runtime.parallel.dp import apply_data_parallel
from autotune.runtime.train import Trainer
from autotune.trialspec import TrialSpec


def build_model(cfg: ModelConfig, layout: Layout, mesh: Meshes, device: torch.device,
                seed: int) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_data_parallel(model, mesh, layout)
    model.to_empty(device=device)
    init_weights(model, seed, cfg.hidden_size, cfg.num_layers)
    return model


def build_trainer(cfg: ModelConfig, layout: Layout, mesh: Meshes, device: torch.device,
                  spec: TrialSpec) -> Trainer:
    """The parallelised model with its optimizer, ready to train on micro-batches."""
    model = build_model(cfg, layout, mesh, device, spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return Trainer(model, optimizer)
