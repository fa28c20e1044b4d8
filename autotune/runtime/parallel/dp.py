"""Data parallel, and what each `zero` value is in torch terms.

Gradients are averaged over dp x cp: every rank that sees different tokens. N below is
the number of ranks that shard state, dp_shard x cp (dp x cp without HSDP).

    zero  parameters        gradients (fp32)        masters + AdamW  built on
    0     full              full, all-reduced       full             ddp.py (Megatron's DDP)
    1     full              full, reduce-scattered  1/N              ddp.py (distributed optimizer)
    2     1/N; gathered at  1/N, reduce-scattered   1/N              fully_shard(reshard_after_forward=False)
          forward, kept     each micro-batch
          until backward
    3     1/N; gathered at  1/N, reduce-scattered   1/N              fully_shard(reshard_after_forward=True)
          forward and       each micro-batch
          again at backward

Mixed precision (bf16; fp16, fp8 and mxfp8 alike, runtime/precision.py): zero 0/1 keep the
parameters in the compute dtype and fp32 masters in the optimizer (ddp.py); zero 2/3 keep
fp32 sharded parameters (the masters) and compute in copies FSDP2 gathers unit by unit
(`MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32)`). fp32 trains in fp32
everywhere.

HSDP (dp_shard < dp, zero >= 1): state is sharded over dp_shard x cp and replicated over
dp_replicate. zero 2/3 use fully_shard on the 2-D (dp_replicate, dp_shard_cp) mesh
(reduce-scatter inside a shard group, all-reduce across replicas); zero 1 slices the
optimizer over dp_shard_cp.

FSDP units (zero 2/3): every block, the embedding, and the root with the final norm and
the head; under expert parallel the routed experts of each MoE block are a unit of their
own on the expert meshes: sharded over edp_shard = dp_shard x cp / ep (HSDP: replicated
over dp_replicate), their gradients reduced over edp = dp x cp / ep and divided by ep once
more (ep.py says why). The root keeps its parameters gathered from the end of forward to
the start of backward (FSDP's default for the root: backward needs the head first).

Gradient accumulation: zero 2/3 reduce-scatter every micro-batch's gradients and keep
only the shard (what ZeRO-2 promises, as torchtitan does), so no unsharded gradient
outlives a micro-batch's backward. Under pipeline parallel torch's schedules turn sync off
for every micro-batch and reduce once after the stage's last backward (pp.py), so a stage
holds its whole gradients from its first backward to that reduction; zero 3 then
keeps its parameters gathered between micro-batches as zero 2 does
(reshard_after_forward=False).

Classic DDP is not used: it does not compose with DTensor tensor parallel.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from autotune.config import ModelConfig
from autotune.plan.layout import Layout
from autotune.runtime.mesh import Meshes
from autotune.runtime.moe import moe_layers
from autotune.runtime.parallel.ddp import DataParallel
from autotune.runtime.parallel.ep import divide_expert_gradients
from autotune.runtime.parallel.gloo_release import release_in_program_order
from autotune.runtime.precision import compute_dtype, grad_dtype, mixed_precision_policy
from autotune.runtime.train import grad_norm


def apply_fully_sharded(model: nn.Module, mesh: Meshes, layout: Layout, cfg: ModelConfig) -> None:
    """zero 2/3: wrap the routed experts (under expert parallel), the blocks, the embedding,
    then the root, on the (meta-device) model or stage. Nothing for zero 0/1 (ddp.py wraps
    the materialised model)."""
    if layout.zero < 2:
        return
    mp_policy = mixed_precision_policy(cfg) or MixedPrecisionPolicy()
    hsdp = mesh.dims.hsdp_enabled
    # Under PP a stage runs several forwards before their backwards: keep its parameters
    # gathered between them (torch's schedules reshard once, after the step's last backward).
    reshard = layout.zero == 3 and not mesh.dims.pp_enabled
    if mesh.dims.ep_enabled:
        experts_mesh = mesh.expert_hsdp() if hsdp else mesh["edp_shard"]
        for layer in moe_layers(model).values():
            shard(layer.experts, mesh=experts_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
            divide_expert_gradients(layer.experts, layout.ep)
    dense_mesh = mesh.hsdp() if hsdp else mesh["dp_shard_cp"]
    for unit in list(model.layers.values()) + [model.tok_embeddings]:
        if unit is not None:
            shard(unit, mesh=dense_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    # The root: backward needs the head first, so it stays gathered from forward to backward.
    shard(model, mesh=dense_mesh, mp_policy=mp_policy, reshard_after_forward=False)


def shard(module: nn.Module, mesh, **options) -> None:
    """fully_shard; on the CPU with gloo's all-gather freeing in program order (gloo_release.py)."""
    fully_shard(module, mesh=mesh, **options)
    if mesh.device_type == "cpu":
        release_in_program_order(module)


class FullySharded:
    """zero 2/3's side of the trainer's data-parallel interface (ddp.DataParallel has the
    same): FSDP2 reduces every micro-batch's gradients itself."""

    def __init__(self, parts: list[nn.Module], **adamw_options):
        self.parts = parts
        self.optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], fused=True,
                                           **adamw_options)

    def before_microbatch(self, last: bool) -> None:
        pass

    def finish_backward(self) -> None:
        pass

    def gradient(self, param: nn.Parameter) -> torch.Tensor:
        return param.grad

    def grad_norm(self, pipeline_group=None) -> torch.Tensor:
        return grad_norm([p for part in self.parts for p in part.parameters()], pipeline_group)

    def scale_gradients(self, factor: torch.Tensor) -> None:
        for part in self.parts:
            for param in part.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)

    def discard_gradients(self) -> None:
        """A skipped step (fp16 overflow): drop the gradients."""
        self.optimizer.zero_grad(set_to_none=True)


def build_data_parallel(parts: list[nn.Module], mesh: Meshes, layout: Layout, cfg: ModelConfig,
                        **adamw_options) -> DataParallel | FullySharded:
    """The materialised, initialised parts' data parallel with its optimizer: ddp.py for
    zero 0/1 (dense parameters reduced over dp x cp, sliced over dp_shard x cp at zero 1;
    expert-parallel experts over edp, sliced over edp_shard), FSDP2 for zero 2/3."""
    if layout.zero >= 2:
        return FullySharded(parts, **adamw_options)

    def param_groups():
        experts = {id(p) for part in parts for layer in moe_layers(part).values()
                   for p in layer.experts.parameters()} if mesh.dims.ep_enabled else set()
        params = [p for part in parts for p in part.parameters()]
        sliced = layout.zero == 1 and mesh.dims.state_shards > 1
        return [([p for p in params if id(p) not in experts], mesh["dp_cp"],
                 mesh["dp_shard_cp"] if sliced else None),
                ([p for p in params if id(p) in experts], mesh["edp"], mesh["edp_shard"] if sliced else None)]

    return DataParallel(parts, param_groups, divisor=mesh.size("dp_cp"), tp=mesh.size("tp"),
                        compute_dtype=compute_dtype(cfg), grad_dtype=grad_dtype(cfg), **adamw_options)
