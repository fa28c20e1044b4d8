"""Apply the layout's parallel dimensions to the plain model, in one documented order.

    meta-device model -> pipeline stages -> TP(+SP) -> EP -> CP -> activation checkpointing
    -> SP's shard-saving hooks (outside no checkpoint: parallel/sp_saved.py)
    -> FSDP (zero 2/3) -> to_empty -> deterministic init -> data parallel (zero 0/1) and the optimizer

(torchtitan's order: TP changes parameter shapes before FSDP shards them; CP swaps
the attention core before recompute wraps it; checkpoint wrappers go inside FSDP so
that FSDP's hooks see whole blocks.) Pipeline parallel splits the model into stages
first and runs `parallelize_stage` on each; expert and context parallel slot in at
their marked places.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune.config import ModelConfig
from autotune.plan.layout import Layout
from autotune.plan.stage_split import stage_count
from autotune.runtime.init import init_weights
from autotune.runtime.mesh import Meshes
from autotune.runtime.model import Transformer
from autotune.runtime.parallel.cp import HeadTailSharder, apply_context_parallel
from autotune.runtime.parallel.dp import apply_fully_sharded, build_data_parallel
from autotune.runtime.parallel.ep import apply_expert_parallel
from autotune.runtime.parallel.pp import PipelineTrainer, build_schedule, split_stages
from autotune.runtime.parallel.recompute import apply_recompute
from autotune.runtime.parallel.sp_saved import save_sequence_shards
from autotune.runtime.parallel.tp import apply_tensor_parallel
from autotune.runtime.precision import LossScaler, convert_to_eight_bit
from autotune.runtime.train import Trainer
from autotune.trialspec import TrialSpec


def parallelize_stage(stage: nn.Module, layout: Layout, mesh: Meshes, cfg: ModelConfig) -> None:
    """Every dimension but PP, applied in place to one (meta-device) model or stage (zero 0/1's
    data parallel comes after materialising: build_data_parallel)."""
    if mesh.dims.tp_enabled:
        apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=bool(layout.sp))
    if mesh.dims.ep_enabled:
        apply_expert_parallel(stage, mesh["ep"])
    if mesh.dims.cp_enabled:
        apply_context_parallel(stage, mesh["cp"], stage.cfg.seq_len)
    apply_recompute(stage, layout.recompute, layout.recompute_layers)
    if mesh.dims.tp_enabled and layout.sp:
        save_sequence_shards(stage, mesh["tp"], layout.recompute, layout.recompute_layers)
    apply_fully_sharded(stage, mesh, layout, cfg)


def build_parts(cfg: ModelConfig, layout: Layout, mesh: Meshes, device: torch.device,
                seed: int, fp8_recipe: str = "tensorwise") -> dict[int, nn.Module]:
    """{stage id: module}: the whole model as stage 0 without PP, else this rank's
    pipeline stages; each parallelised, materialised and initialised. fp8 / mxfp8 swap
    the blocks' linears for torchao's first, so that every dimension sees them."""
    with torch.device("meta"):
        model = Transformer(cfg)
    parts = split_stages(model, cfg, layout, mesh.local_rank("pp")) if mesh.dims.pp_enabled else {0: model}
    for part in parts.values():
        convert_to_eight_bit(part, cfg, device, fp8_recipe)
        parallelize_stage(part, layout, mesh, cfg)
        part.to_empty(device=device)
        init_weights(part, seed, cfg.hidden_size, cfg.num_layers)
    return parts


def build_trainer(cfg: ModelConfig, layout: Layout, mesh: Meshes, device: torch.device,
                  spec: TrialSpec) -> Trainer | PipelineTrainer:
    """The parallelised model with its optimizer, ready to train on micro-batches."""
    parts = build_parts(cfg, layout, mesh, device, spec.seed, spec.extra.get("fp8_recipe", "tensorwise"))
    dp = build_data_parallel(list(parts.values()), mesh, layout, cfg, lr=spec.lr, betas=(0.9, 0.95),
                             weight_decay=0.1)
    # Under TP the logits stay vocab-sharded and the loss is computed on the shards.
    shard_batch = HeadTailSharder(mesh["cp"]) if mesh.dims.cp_enabled else None
    scaler = LossScaler() if cfg.dtype == "fp16" else None
    if scaler is not None and cfg.moe is not None:
        raise ValueError("fp16 with MoE: the balance loss's gradient is not loss-scaled yet; train bf16")
    if not mesh.dims.pp_enabled:
        return Trainer(parts[0], dp, shard_batch, max_grad_norm=spec.max_grad_norm, loss_scaler=scaler)
    if scaler is not None:
        raise ValueError("fp16 under pipeline parallel: the loss scaler is not wired into torch's schedules "
                         "yet; train bf16 there")
    pp_group = mesh["pp"].get_group()
    schedule, releaser = build_schedule(parts, layout, layout.grad_accum(cfg), pp_group, device, dp)
    return PipelineTrainer(parts, schedule, dp, stage_count(layout), pp_group, shard_batch,
                           max_grad_norm=spec.max_grad_norm, releaser=releaser)
