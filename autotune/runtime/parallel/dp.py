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
final norm and the output head. At zero=3 the root keeps its parameters gathered from
the end of forward to the start of backward (FSDP's default for the root), because
backward needs the head first.

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
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from autotune.config import ModelConfig
from autotune.layout import Layout
from autotune.runtime.mesh import Meshes
from autotune.runtime.parallel.zero1 import zero_one_adamw


def mixed_precision_policy(cfg: ModelConfig, device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 compute, fp32 reduction and master weights for a bf16 model on CUDA; else None (fp32)."""
    if device.type == "cuda" and cfg.dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_data_parallel(model: nn.Module, mesh: Meshes, layout: Layout,
                        mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Wrap the blocks, then the embedding, then the root, according to layout.zero."""
    if mesh.size("dp_cp") == 1 and mp_policy is None:
        return
    mp_policy = mp_policy or MixedPrecisionPolicy()
    units = list(model.layers.values())
    if model.tok_embeddings is not None:
        units.append(model.tok_embeddings)
    if layout.zero <= 1:
        for unit in units:
            replicate(unit, mesh=mesh["dp_cp"], mp_policy=mp_policy)
        replicate(model, mesh=mesh["dp_cp"], mp_policy=mp_policy)
        return
    shard_mesh = mesh.hsdp() if mesh.size("dp_replicate") > 1 else mesh["dp_shard_cp"]
    # Under PP a stage runs several forwards before their backwards: keep its parameters
    # gathered between them (torch's schedules reshard once, after the step's last backward).
    reshard = layout.zero == 3 and layout.pp == 1
    for unit in units:
        fully_shard(unit, mesh=shard_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=shard_mesh, mp_policy=mp_policy, reshard_after_forward=False)


def build_optimizer(model: nn.Module, mesh: Meshes, layout: Layout, **adamw_options) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; at zero=1, over this rank's slices of them."""
    params = list(model.parameters())
    if layout.zero == 1 and mesh.size("dp_shard_cp") > 1:
        return zero_one_adamw(params, mesh["dp_shard_cp"], **adamw_options)
    return torch.optim.AdamW(params, **adamw_options)
