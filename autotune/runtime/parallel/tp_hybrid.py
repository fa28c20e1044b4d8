"""Tensor parallel of a hybrid model's blocks (runtime/hybrid.py), as tp.py cuts the plain ones.

    Mamba-2:   in_z, in_x (heads/tp heads each), in_B, in_C (groups/tp groups), in_dt (heads/tp)
               column-parallel; out_proj row-parallel; the per-head and per-channel weights
               (the convolution's taps and biases, A_log, D, dt_bias, the gated norm) cut the
               same way, Shard(0). Rank r holds heads [r*H/tp, ...) and groups [r*G/tp, ...),
               the groups its heads read, so the scan and the per-group norm need no
               communication: one all-reduce (or all-gather + reduce-scatter with SP) per
               block, as Megatron-LM's Mamba mixer.
    attention: wq, wk, wv column-parallel, wo row-parallel (no RoPE in a hybrid model)
    MLP:       up (and gate) column-parallel, down row-parallel
    MoE:       whole on every rank, as in tp.py

Each block has one norm, sequence-parallel under SP, and its mixer's input enters as one
replicated DTensor that the column-parallel linears share (tp.py says why).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autotune.runtime.hybrid import HybridBlock
from autotune.runtime.mlp import FeedForward

MAMBA_INPUTS = ("in_z", "in_x", "in_B", "in_C", "in_dt")


def _shard_own_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """distribute_module's partition_fn: every parameter not yet a DTensor, cut by rows."""
    for pname, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                          requires_grad=param.requires_grad))


def parallelize_hybrid_block(block: HybridBlock, tp_mesh: DeviceMesh, stream, sequence_parallel: bool) -> None:
    whole = {"input_layouts": (stream,), "desired_input_layouts": (Replicate(),)}
    plan = {}
    if block.mamba is not None:
        plan.update({f"mamba.{name}": ColwiseParallel() for name in MAMBA_INPUTS})
        plan["mamba.out_proj"] = RowwiseParallel(output_layouts=stream)
        plan["mamba"] = PrepareModuleInput(**whole, use_local_output=False)
    elif block.attention is not None:
        plan.update({f"attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")})
        plan["attention.wo"] = RowwiseParallel(output_layouts=stream)
        plan["attention"] = PrepareModuleInput(**whole, use_local_output=False)
    elif isinstance(block.mlp, FeedForward):
        plan.update({"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=stream),
                     "mlp": PrepareModuleInput(**whole, use_local_output=False)})
        if block.mlp.gate is not None:
            plan["mlp.gate"] = ColwiseParallel()
    elif sequence_parallel:  # MoE: whole, on the gathered sequence
        plan["mlp"] = PrepareModuleInputOutput(
            **whole, use_local_input=True, output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
            use_local_output=True)
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    parallelize_module(block, tp_mesh, plan)
    if block.mamba is not None:
        distribute_module(block.mamba, tp_mesh, _shard_own_parameters)
    if block.attention is not None:
        for norm in (block.attention.q_norm, block.attention.k_norm):
            if norm is not None:
                distribute_module(norm, tp_mesh)
