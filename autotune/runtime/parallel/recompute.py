"""Activation recompute (checkpointing): keep fewer activations, recompute them in backward.

    none       every activation the backward needs is kept from the forward.
    selective  the attention core of each block is recomputed (Megatron's selective
               recompute): its inputs q, k, v are kept and it runs again in backward.
               With a fused attention kernel that drops only what the kernel keeps of
               its own (the log-sum-exp and, on the math path, the seq^2 scores); under
               context parallel the ring runs again, its KV blocks passing round once more.
    op         per-op (torchtitan's selective "op" checkpointing): each block is
               checkpointed with torchtitan's op policy (torch's selective activation
               checkpoint): of the block's matmuls, in forward order, the first, third,
               fifth... outputs are kept and every second one recomputed (a dense
               Llama block keeps wq, wv, up and down, recomputes wk, wo and gate);
               the outputs of the experts' grouped matmuls, of fused attention kernels
               (context parallel's ring attention included, as one kernel whose
               transfers are not replayed), of the collectives that end a
               tensor-parallel half (all-reduce, reduce-scatter) and of expert
               parallel's token all-to-alls are kept; everything else (norms, RoPE,
               SiLU and gating, casts, the router's softmax) is recomputed from them in
               backward. Sequence-parallel all-gathers are recomputed (one more
               all-gather per half).
    full       each transformer block is recomputed from its input: a block keeps one
               [batch, seq, hidden] tensor (seq/tp with sequence parallel) instead of all
               its intermediates, for about one more forward of the whole model. With
               recompute_layers K, only the first K blocks of each pipeline stage (of the
               model without PP), Megatron's `--recompute-method block`.

MoE blocks under op recompute are checkpointed by parts instead (attention_norm,
attention, mlp_norm, the routed experts, the shared experts: each part counts its
own matmuls, and the routed experts keep every output), the router's glue
(softmax, top-k, permutation) running outside: under expert parallel the experts are
an FSDP unit of their own, and an FSDP unit inside a selectively checkpointed region
breaks torch's check that the recompute replays the forward's ops (FSDP's hooks do
different work in recompute). The experts' own wrapper becomes their FSDP unit, so
FSDP's hooks stay outside it, as they do for a dense block.

Applied after tensor and context parallel (so the recomputed code is the parallel
code, collectives included) and before data parallel (so FSDP's hooks see the
checkpointed block as one unit). The wrappers are torch's non-reentrant
`checkpoint_wrapper`; they add `_checkpoint_wrapped_module.` to parameter names,
which init and the tests strip.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autotune.runtime.moe import MoE
from autotune.runtime.torch_compat import checkpoint_wrapper
from autotune_kernels.attention import RING_ATTENTION_OP

aten = torch.ops.aten
# The ops whose outputs op recompute keeps (aten.mm: every second one, MATMULS).
SAVED_OPS = {
    aten.mm.default,
    aten._grouped_mm.default,  # the MoE experts' grouped matmuls
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    RING_ATTENTION_OP,  # context parallel's ring: kept whole, its P2P transfers never replayed
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}


MATMULS = (aten.mm.default, aten.linear.default)


def keep_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Every output of SAVED_OPS kept: the routed experts, whose matmuls (a loop of mm on
    the CPU, one grouped mm on a GPU) torchtitan keeps whole."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def alternate_matmuls():
    """torchtitan's op policy for one checkpointed call: SAVED_OPS kept, but of the plain
    matmuls every second one recomputed, counted apart in the forward and in the
    recompute so both pick the same ones. A new count per call (context_fn runs per
    forward), so each block starts at its first matmul."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return keep_expensive_ops(ctx, op, *args, **kwargs)

    return create_selective_checkpoint_contexts(policy)


keep_all = functools.partial(create_selective_checkpoint_contexts, keep_expensive_ops)


def apply_recompute(model: nn.Module, mode: str, layers: int = 0) -> None:
    """Wrap the blocks of `model` (a whole model or one pipeline stage) in place; `mode` and
    `layers` are a layout's recompute and recompute_layers, already checked."""
    if mode == "none":
        return
    options = {"preserve_rng_state": False}  # the model has no dropout: nothing random to replay
    if mode == "selective":
        for block in model.layers.values():
            if block.attention is not None:  # a hybrid model's Mamba and MLP blocks have none
                block.attention.core = checkpoint_wrapper(block.attention.core, **options)
        return
    if mode == "op":
        options["context_fn"] = alternate_matmuls
    names = list(model.layers)[:layers] if layers else list(model.layers)
    for name in names:
        block = model.layers[name]
        if mode == "op" and isinstance(block.mlp, MoE):
            # A hybrid MoE block (runtime/hybrid.py) has one norm before its MoE and no attention.
            for part in ("norm",) if hasattr(block, "mixer_name") else ("attention_norm", "attention", "mlp_norm"):
                setattr(block, part, checkpoint_wrapper(getattr(block, part), **options))
            block.mlp.experts = checkpoint_wrapper(block.mlp.experts, **{**options, "context_fn": keep_all})
            if block.mlp.shared is not None:
                block.mlp.shared = checkpoint_wrapper(block.mlp.shared, **options)
        else:
            model.layers[name] = checkpoint_wrapper(block, **options)
