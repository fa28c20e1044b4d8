"""Data parallel on FSDP2, and what each `zero` value is in torch terms.

Gradients are averaged over dp x cp: every rank that sees different tokens. N below
is the number of ranks that shard state, dp_shard x cp (dp x cp without HSDP).

    zero  parameters       gradients            optimizer state  torch
    0     full             full, all-reduced    full             replicate (FSDP2's replicate form) on dp_cp
    1     full             full, all-reduced    1/N              replicate on dp_cp + AdamW over 1/N slices (zero1.py)
    2     1/N; gathered    1/N, reduce-         1/N              fully_shard(reshard_after_forward=False)
          at forward, kept scattered
          until backward
    3     1/N; gathered    1/N, reduce-         1/N              fully_shard(reshard_after_forward=True)
          at forward and   scattered
          again at backward

HSDP (dp_shard < dp, zero >= 1): state is sharded over dp_shard x cp and replicated
over dp_replicate. zero 2/3 use fully_shard on the 2-D (dp_replicate, dp_shard_cp)
mesh (reduce-scatter inside a shard group, all-reduce across replicas); zero=1 slices
the optimizer over dp_shard_cp.

Under pipeline parallel zero 3 keeps its parameters gathered between micro-batches as
zero 2 does (reshard_after_forward=False; see pp.py for what the schedules do).

Units: every block is its own FSDP unit (one all-gather / reduce per block, overlapped
with the neighbouring blocks' compute), the embedding another, and the root holds the
final norm and the output head. Under expert parallel the routed experts of each MoE
block are a unit of their own, wrapped the same way but on the expert meshes: they
are sharded over edp_shard = dp_shard x cp / ep (HSDP: replicated over dp_replicate)
and their gradients reduced over edp = dp x cp / ep, the ranks that hold the same
experts (runtime/parallel/ep.py says why that gives the right average). At zero=3 the
root keeps its parameters gathered from the end of forward to the start of backward
(FSDP's default for the root), because backward needs the head first.

Classic DDP is not used: it does not compose with DTensor tensor parallel, FSDP2's
replicate does.

Gradient accumulation: the trainer turns gradient sync off for all micro-batches but
the last (`set_requires_gradient_sync`); zero 2/3 then hold unsharded gradients
between micro-batches, the usual price of skipping the reduce-scatters.

Mixed precision (`mixed_precision_policy`): on the CPU everything is fp32. On CUDA,
a model whose dtype is bf16 keeps fp32 parameters (the master weights the optimizer
updates) and fp32 gradient reduction, and computes in bf16: FSDP2 casts the gathered
parameters to bf16 at each unit. At dp x cp = 1 there is nothing to reduce, but the
model is still wrapped (replicate over a one-rank mesh, no communication) so that a
single-GPU or TP-only layout computes in the same precision as every other layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from autotune.config import ModelConfig
from autotune.layout import Layout
from autotune.runtime.mesh import Meshes
from autotune.runtime.moe import moe_layers
from autotune.runtime.parallel.ep import divide_expert_gradients
from autotune.runtime.parallel.zero1 import zero_one_adamw
from autotune.runtime.torch_compat import replicate


def mixed_precision_policy(cfg: ModelConfig) -> MixedPrecisionPolicy | None:
    """bf16 compute, fp32 reduction and master weights for a model that trains in bf16 (its
    dtype is the trained one: config.as_trained), on any device; else None (fp32)."""
    if cfg.dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_data_parallel(model: nn.Module, mesh: Meshes, layout: Layout,
                        mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Wrap the routed experts (under expert parallel), the blocks, the embedding, then
    the root, according to layout.zero."""
    if not mesh.dims.dp_enabled and mp_policy is None:
        return
    mp_policy = mp_policy or MixedPrecisionPolicy()
    hsdp = mesh.dims.hsdp_enabled
    # Under PP a stage runs several forwards before their backwards: keep its parameters
    # gathered between them (torch's schedules reshard once, after the step's last backward).
    reshard = layout.zero == 3 and not mesh.dims.pp_enabled
    if mesh.dims.ep_enabled:
        experts_mesh = mesh["edp"] if layout.zero <= 1 else mesh.expert_hsdp() if hsdp else mesh["edp_shard"]
        for layer in moe_layers(model).values():
            wrap(layer.experts, experts_mesh, layout.zero, mp_policy, reshard)
            divide_expert_gradients(layer.experts, layout.ep)
    dense_mesh = mesh["dp_cp"] if layout.zero <= 1 else mesh.hsdp() if hsdp else mesh["dp_shard_cp"]
    for unit in list(model.layers.values()) + [model.tok_embeddings]:
        if unit is not None:
            wrap(unit, dense_mesh, layout.zero, mp_policy, reshard)
    wrap(model, dense_mesh, layout.zero, mp_policy, reshard=False)  # the root: backward needs the head first


def wrap(unit: nn.Module, mesh, zero: int, mp_policy: MixedPrecisionPolicy, reshard: bool) -> None:
    """One FSDP unit as `zero` says (module docstring); `mesh` is 1-D for replicate and
    sharding, 2-D (replicate, shard) for HSDP."""
    if zero <= 1:
        replicate(unit, mesh=mesh, mp_policy=mp_policy)
    else:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)


def build_optimizer(model: nn.Module, mesh: Meshes, layout: Layout, **adamw_options) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; at zero=1, over this rank's slices of them:
    dense parameters sliced over dp_shard x cp, expert-parallel experts over edp_shard."""
    params = list(model.parameters())
    if layout.zero != 1 or mesh.dims.state_shards == 1:
        return torch.optim.AdamW(params, **adamw_options)
    experts = {id(p) for layer in moe_layers(model).values() for p in layer.experts.parameters()} \
        if mesh.dims.ep_enabled else set()
    groups = [([p for p in params if id(p) not in experts], mesh["dp_shard_cp"]),
              ([p for p in params if id(p) in experts], mesh["edp_shard"])]
    return zero_one_adamw([(group, group_mesh) for group, group_mesh in groups if group], **adamw_options)
