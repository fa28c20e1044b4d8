"""Pipeline parallel on torch.distributed.pipelining: stages, schedule, trainer.

Written here: only the split. The meta-device model is deep-copied once per stage a
rank runs and pruned to that stage's layers (stage_split.py says which, and which
stages each rank runs); the first stage keeps the embedding, the last the final norm
and the head, the others have them set to None, which the model's forward skips. The
layers keep their global names (a ModuleDict keyed by layer index), so init and the
tests see the plain model's parameter names. Each stage is then parallelised like a
whole model (parallelize.parallelize_stage) and wrapped in a `PipelineStage`.

torch's schedules run everything else: autotune/plan/schedules.py names each schedule's
torch class, its stages per rank and the micro-batch counts it takes (layout.check
holds each schedule's own preconditions). The loss: the schedule is built
with scale_grads=False and a loss function that divides each micro-batch's token mean
by the number of micro-batches, exactly as the unpipelined Trainer does, so losses and
every gradient (also any that a layer injects into autograd itself) are those of one
process. The trainer returns the sum of those scaled losses on the rank that runs the
last stage (zero elsewhere) plus, on every rank, the MoE balance losses its own stages
recorded; trial.global_losses sums them over the pipeline ranks and averages them
over the data-parallel ranks.

FSDP under PP: each stage is its own FSDP root. The schedules turn gradient sync and
resharding after backward off for every micro-batch and, once a stage's last backward
is done, run FSDP's post-backward themselves (`perform_reduce_grad`): one
reduce-scatter (zero 2/3) or all-reduce (zero 0/1) per step. With scale_grads=False
they do not rescale gradients afterwards. So from a stage's first backward to that
reduction the rank holds the stage's whole gradients (in FSDP's reduce dtype), not their
shards. Kept as torch and torchtitan have it, the layout's verdict being torchtitan's: a
reduce-scatter per micro-batch would hold only the shards but multiply the data-parallel
traffic by the micro-batches of a step (4 to 64 in pipelines); the estimator prices the
whole gradients (estimate/memory.py, gradients_held). The runtime builds FSDP with
reshard_after_forward=False under PP (dp.py), so the gathered parameters stay from the
step's first forward to that reduction; zero 3 then behaves as zero 2. The multi-stage
schedules also gather each stage's parameters explicitly before its first action
(UNSHARD) and free them after the step (RESHARD).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules

from autotune.config import ModelConfig
from autotune.plan.layout import Layout
from autotune.plan.schedules import SCHEDULES
from autotune.plan.stage_split import rank_stage_ids, stage_count, stage_layers
from autotune.runtime.model import Transformer
from autotune.runtime.moe import discard_step, end_step, set_aux_loss_scale
from autotune.runtime.parallel.pp_sends import SendReleaser
from autotune.runtime.torch_compat import LeanPipelineStage, capturing_pipeline_posts
from autotune.runtime.train import clip, cross_entropy


def split_stages(model: Transformer, cfg: ModelConfig, layout: Layout, pp_rank: int) -> dict[int, Transformer]:
    """{stage id: a pruned deep copy of the (meta-device) model} for the stages this
    pipeline rank runs."""
    stages = stage_count(layout)
    layers = stage_layers(cfg, stages)
    parts = {}
    for stage_id in rank_stage_ids(layout, pp_rank):
        part = copy.deepcopy(model)
        for name in list(part.layers):
            if int(name) not in layers[stage_id]:
                del part.layers[name]
        if stage_id != 0:
            part.tok_embeddings = None
        if stage_id != stages - 1:
            part.norm = None
            part.output = None
        parts[stage_id] = part
    return parts


class ScaledLoss:
    """The pipeline's loss function: a micro-batch's token mean / micro-batches per step."""

    def __init__(self, microbatches: int):
        self.microbatches = microbatches

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels) / self.microbatches


class Stage(LeanPipelineStage):
    """torch's PipelineStage. On the first step torch infers the stages' tensor shapes by
    running one real forward and backward (dynamic metadata inference), then clears the
    gradients it made. Its backward also records MoE balance-loss terms and expert
    counts, which belong to no step (and on a later stage come from an uninitialised
    input: NaN); they go when torch cleans up after the inference."""

    gradients = None  # zero 0/1's data parallel (ddp.py), set once it exists: it takes `.grad` into its buffer
    releaser: SendReleaser | None = None  # a lowered schedule's early waits for sends (pp_sends.py)

    def after_metadata_inference(self) -> None:
        discard_step(self.submod)

    def after_weight_step(self) -> None:
        if self.gradients is not None:
            self.gradients.fold_gradients()

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        if self.releaser is not None:
            self.releaser.sending("F", self.stage_index, fwd_chunk_id)
        return super().get_fwd_send_ops(fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        if self.releaser is not None:
            self.releaser.sending("B", self.stage_index, bwd_chunk_id)
        return super().get_bwd_send_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if self.releaser is not None:  # called once the activation has been received
            self.releaser.consuming("F", self.stage_index, fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        if self.releaser is not None:  # called once the gradient has been received
            self.releaser.consuming("B", self.stage_index, bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


def build_schedule(parts: dict[int, nn.Module], layout: Layout, microbatches: int,
                   pp_group: dist.ProcessGroup, device: torch.device, dp=None):
    """(torch's schedule for `layout.schedule` over this rank's stages, its SendReleaser or
    None); `dp`, the data parallel, takes the gradients a split backward's weight steps
    write. A lowered schedule's sends are freed once they have arrived (pp_sends.py)."""
    stages = [Stage(part, stage_id, stage_count(layout), device, group=pp_group)
              for stage_id, part in sorted(parts.items())]
    for stage in stages:
        stage.gradients = dp if hasattr(dp, "fold_gradients") else None
    schedule = SCHEDULES[layout.schedule]
    schedule_class = getattr(schedules, schedule.torch_class)
    built = schedule_class(stages if schedule.multi_stage else stages[0], n_microbatches=microbatches,
                           loss_fn=ScaledLoss(microbatches), scale_grads=False)
    orders = getattr(built, "pipeline_order_with_comms", None)  # the lowered action lists of every rank
    if not schedule.lowered or not orders:
        return built, None
    releaser = SendReleaser(orders, built.stage_index_to_group_rank, dist.get_rank(pp_group))
    for stage in stages:
        stage.releaser = releaser
    return built, releaser


class PipelineTrainer:
    """The Trainer's `step(batches)` on a pipelined model: one schedule step over the
    step's micro-batches, then clipping and the optimizer step."""

    def __init__(self, parts: dict[int, nn.Module], schedule, dp, num_stages: int, pp_group: dist.ProcessGroup,
                 shard_batch=None, max_grad_norm: float | None = None, releaser: SendReleaser | None = None):
        self.model = [part for _, part in sorted(parts.items())]  # this rank's stages
        self.schedule = schedule
        self.releaser = releaser
        self.dp = dp  # its data parallel (parallel/dp.py): reduces the gradients, owns the optimizer
        self.optimizer = dp.optimizer
        self.pp_group = pp_group
        self.shard_batch = shard_batch  # (inputs, labels) -> this rank's part, under context parallel
        self.max_grad_norm = max_grad_norm
        self.holds_inputs = 0 in parts
        self.holds_loss = num_stages - 1 in parts

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Train on this rank's micro-batches; returns the rank's share of the loss: the
        token loss on the rank with the last stage, plus its own stages' MoE balance losses."""
        if self.shard_batch is not None:
            batches = [self.shard_batch(x, y) for x, y in batches]
        set_aux_loss_scale(self.model, 1 / len(batches))  # MoE balance losses scale as the loss does
        inputs = torch.cat([x for x, _ in batches])  # the schedule cuts it back into the same micro-batches
        labels = torch.cat([y for _, y in batches])
        losses: list[torch.Tensor] = []
        releaser = self.releaser
        with capturing_pipeline_posts(releaser.posted) if releaser else contextlib.nullcontext():
            self.schedule.step(*((inputs,) if self.holds_inputs else ()), target=labels if self.holds_loss else None,
                               losses=losses, return_outputs=False)
        if releaser:
            releaser.end_step()
        self.dp.finish_backward()  # zero 0/1 reduce after the schedule, as FSDP's do there
        clip(self.dp, self.max_grad_norm, self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=inputs.device)
        for loss in losses:
            total += loss.detach()
        return total + end_step(self.model, total.device)
