"""Tensor parallel (Megatron-style) with optional sequence parallel, on DTensor.

Each block's attention and MLP are cut into a column-parallel first half and a
row-parallel second half, so one all-reduce (or, with SP, one all-gather and one
reduce-scatter) per half is all the communication a block needs:

    attention: wq, wk, wv column-parallel (each rank computes heads/tp query heads and
               kv_heads/tp kv heads; the model views q/k/v with -1 heads, so it runs the
               per-rank head count untouched), wo row-parallel
    MLP:       gate (gated kinds), up column-parallel (ffn/tp columns each), down row-parallel
    QK-norm:   its weights replicated (each rank normalises its own heads; their
               gradients are partial sums over tp, reduced like the SP norms')
    MLA:       wq or wq_b, and wkv_b column-parallel (heads/tp heads each), wo
               row-parallel; the down projections and latent norms left whole, like
               the MoE blocks; the shared RoPE key's gradient all-reduced (runtime/mla.py)
    embedding: vocabulary-parallel (row-wise: each rank owns vocab/tp rows, the partial
               embeddings are summed)
    output:    vocabulary-parallel (column-wise) and left sharded: the loss is computed
               on vocab-sharded logits (autotune_kernels.loss), so the full [tokens, vocab]
               logits never exist on one rank. The loss is then a DTensor
               (`.full_tensor()` before any other collective).

GQA stays correct under this split: query head h uses kv head h // (heads / kv_heads);
with contiguous column blocks rank r holds query heads [r*heads/tp, ...) and kv heads
[r*kv_heads/tp, ...), which are exactly the kv heads its query heads use. The layout
rules refuse heads, kv heads, ffn or vocab that do not divide by tp.

MoE blocks are not cut: the router and every expert stay whole on each tp rank, which
all run the same routing on the same (gathered) tokens; expert parallel spreads the
experts instead. Under sequence parallel the block's input is all-gathered like an
MLP's and each rank keeps its own sequence shard of the (replicated) output, whose
backward all-gathers the gradient.

A hybrid model's single-mixer blocks, Mamba-2 among them, are cut by tp_hybrid.py.

Sequence parallel (sp=1): outside attention and MLP (norms, residual adds) the
activations are cut along the sequence instead of replicated, so norms run on seq/tp
tokens and the residual stream takes 1/tp of the memory. The row-parallel outputs
reduce-scatter onto the sequence shards, and each attention / MLP input is all-gathered
back to the full sequence (`PrepareModuleInput`), so attention always sees whole
sequences and the model's positions stay 0..seq-1.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autotune.runtime.hybrid import HybridBlock
from autotune.runtime.mla import MLAttention
from autotune.runtime.mlp import FeedForward
from autotune.runtime.parallel.tp_hybrid import parallelize_hybrid_block


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard the (meta-device) model's weights over `tp_mesh` in place.

    Runs on a pipeline stage as well as on the whole model: a stage lacks the
    embedding, the final norm or the head (None), and those plans are skipped.
    """
    # Between blocks the residual stream is sequence-sharded (SP) or replicated.
    stream = Shard(1) if sequence_parallel else Replicate()
    top_plan = {}
    if model.tok_embeddings is not None:
        top_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None and sequence_parallel:
        top_plan["norm"] = SequenceParallel()
    if model.output is not None:
        # Logits stay a vocab-sharded DTensor: the loss works on each rank's columns.
        top_plan["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                             use_local_output=False)
    parallelize_module(model, tp_mesh, top_plan)

    for block in model.layers.values():
        if isinstance(block, HybridBlock):  # one mixer a block: tp_hybrid.py
            parallelize_hybrid_block(block, tp_mesh, stream, sequence_parallel)
            continue
        attention = block.attention
        if isinstance(attention, MLAttention):
            plan = {f"attention.{name}": ColwiseParallel()
                    for name in ("wq", "wq_b", "wkv_b") if getattr(attention, name) is not None}
        else:
            plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel()}
        plan["attention.wo"] = RowwiseParallel(output_layouts=stream)
        dense = isinstance(block.mlp, FeedForward)  # MoE blocks stay whole (module docstring)
        if dense:
            plan.update({
                "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel(output_layouts=stream),
            })
            if block.mlp.gate is not None:  # gated kinds only
                plan["mlp.gate"] = ColwiseParallel()
        # Attention's and a dense MLP's input enters as one replicated DTensor that wq, wk, wv
        # (gate, up) share: their input gradients are partial sums that autograd adds as
        # DTensors, and the input's own backward reduces them once per half (a reduce-scatter
        # onto the sequence shards under SP, an all-reduce without). A plain tensor there
        # would let each column-parallel linear all-reduce its own input gradient: three
        # all-reduces for attention, two for a gated MLP, where Megatron-LM has one.
        whole = {"input_layouts": (stream,), "desired_input_layouts": (Replicate(),)}
        if not isinstance(attention, MLAttention):  # MLA's whole down projections take plain tensors
            plan["attention"] = PrepareModuleInput(**whole, use_local_output=False)
        if dense:
            plan["mlp"] = PrepareModuleInput(**whole, use_local_output=False)
        elif sequence_parallel:
            plan["mlp"] = PrepareModuleInputOutput(
                **whole, use_local_input=True, output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                use_local_output=True)
        if sequence_parallel:
            # The norms hand on sequence shards; attention and MLP need whole sequences.
            plan.update({"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
            if isinstance(attention, MLAttention):
                plan["attention"] = PrepareModuleInput(**whole, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        if isinstance(attention, MLAttention):
            attention.tp_mesh = tp_mesh
            continue
        for norm in (attention.q_norm, attention.k_norm):
            if norm is not None:  # QK-norm: one weight for every head, replicated over tp
                distribute_module(norm, tp_mesh)
