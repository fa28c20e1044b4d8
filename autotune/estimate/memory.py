"""Peak memory of one rank for a layout: what our runtime keeps, term by term.

The terms (`TERMS`), in the trained precision (fp32, or bf16 mixed precision):

    params           the parameters as the model holds them: zero 0/1 in the compute dtype
                     (bf16: 2 bytes), zero 2/3 FSDP's fp32 shards
    master_params    zero 0/1 in bf16: the fp32 masters AdamW updates (sliced over the
                     shard ranks at zero 1); FSDP's shards are their own masters
    grads            zero 0/1: the gradient buffer (fp32, or grad_dtype's 2 bytes; always
                     there); zero 2/3: the fp32 gradient shards, once a micro-batch is reduced;
                     under PP the stage's whole gradients from its first backward
    optimizer        AdamW's two fp32 states (8 bytes, sharded at zero >= 1)
    gathered_params  zero 2/3: the parameters FSDP has gathered (compute dtype)
    activations      what autograd saves, over the micro-batches in flight
    pipeline_buffers what pipeline parallel adds: stage outputs kept until their backward,
                     sends not yet known to have arrived (runtime/parallel/pp_sends.py)
    logits           the loss's: one micro-batch's logits, their gradient, fp32 chunks
    temporaries      what lives only at the moment of the peak (a backward's gradients)
    overhead         token ids; on CUDA the allocator's fixed workspaces

Bytes per parameter of the state (no activations), P the rank's parameters, N the
ranks that shard it:  zero 0: 16 (fp32) or 18 (bf16: 2 + 4 + 4 + 8);  zero 1: 8 + 8/N or
6 + 12/N;  zero 2/3: 16/N, the gathered parameters and gradient shards coming and going.
With bf16 gradients (grad_dtype) zero 0/1 keep 2 bytes of buffer, and the step adds an fp32
copy of the rank's slice: 16 + 4 at zero 0, 4 + 16/N at zero 1, as Megatron-LM's table.

The peak is the largest of a few moments of a step (rank_terms):
- loss_backward (the rank with the head): every activation held, the logits, their
  gradient and the loss's fp32 chunks;
- layer_backward: the loss's buffers freed, the last layer's SwiGLU backward holds the
  incoming gradient, a weight gradient on its way into the buffer and tokens x ffn
  gradients; recompute rebuilds that layer first;
- optimizer_step: the gradients complete, the state updated in place (torch's fused
  AdamW makes no temporaries), zero 1's all-gather bucket;
- backward_end (zero 2/3): FSDP's last reductions, of the head's and the embedding's
  whole gradients; under PP the step's one reduction of the stage's whole gradients.

Activations are the tensors autograd saves, itemised per layer for our block (the
runtime's model, measured by saved-tensor hooks on the CPU) in the accounting of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): the same items with the paper's GPT block give its sbh(34 + 5as/h), and its
TP, SP and recompute adjustments. Context parallel divides every per-token term by cp:
each rank holds seq_len/cp tokens of each sequence, and ring attention saves what fused
attention saves for its own tokens. Against trials on the CPU (the allocator's own
peaks, runtime/memory.py): benchmarks/estimator_accuracy.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from autotune.config import ModelConfig, model_size, per_model_object
from autotune.errors import UsageError
from autotune.estimate import mamba
from autotune.plan.layout import Layout
from autotune.plan.schedules import SCHEDULES
from autotune.plan.stage_split import rank_stage_ids, stage_count, stage_layers

DEVICES = ("cpu", "cuda")
# Bytes the CUDA allocator hands out besides the model's tensors: cuBLAS workspaces and
# small buffers. The CUDA context and NCCL's buffers are outside the allocator, as they
# are outside the measured peak (the allocator's statistics).
CUDA_FIXED_OVERHEAD_BYTES = 256 * 1024**2
# The loss works on this many fp32 logits at once (autotune_kernels/loss.py).
LOSS_CHUNK_ELEMENTS = 1 << 22
# zero 1 gathers the updated parameters a bucket at a time (runtime/parallel/ddp.py).
DDP_BUCKET_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor the runtime keeps."""

    master: int  # parameters as the optimizer updates them (fp32), and the gradients it reads
    grad: int  # gradients as they are reduced and accumulated (fp32, or grad_dtype's 2 bytes)
    optimizer: int  # AdamW exp_avg + exp_avg_sq
    compute: int  # activations, and the parameters the model computes with
    # fp8 / mxfp8: bytes per element of the 8-bit copies a linear's GEMMs take (0: none),
    # and of their scales (tensorwise: one fp32 per tensor, ~0; MX: one e8m0 byte per 32).
    cast: float = 0.0
    scale: float = 0.0


# By the precision the model trains in (estimate() gives the model its trained dtype). fp16
# holds what bf16 holds (its loss scaler is one float). fp8 and mxfp8 (torchao) keep bf16
# parameters, activations and communication: a converted linear saves its bf16 input and
# weight for backward, as bf16 does, and casts them, and the output gradient, to 8 bits
# afresh for each GEMM; those casts live only while their GEMM runs.
_PRECISIONS = {"bf16": Precision(master=4, grad=4, optimizer=8, compute=2),
               "fp16": Precision(master=4, grad=4, optimizer=8, compute=2),
               "fp8": Precision(master=4, grad=4, optimizer=8, compute=2, cast=1.0),
               "mxfp8": Precision(master=4, grad=4, optimizer=8, compute=2, cast=1.0, scale=1 / 32),
               "fp32": Precision(master=4, grad=4, optimizer=8, compute=4)}


def precision(model: ModelConfig, device: str) -> Precision:
    if device not in DEVICES:
        raise UsageError(f"device: must be one of {', '.join(DEVICES)}, got {device!r}")
    prec = _PRECISIONS[model.dtype]
    return prec if model.grad_dtype == "fp32" else dataclasses.replace(prec, grad=prec.compute)


# -- activations: what autograd saves, per token of a micro-batch ------------------------------

@dataclass(frozen=True)
class Saved:
    """One tensor autograd keeps for the backward pass, counted per token.

    `split` says how tensor parallel divides it: "tp" always (heads, MLP columns);
    "sp" only with sequence parallel (the residual stream, norms and their outputs);
    "full" never (what every tp rank computes whole: MoE blocks, MLA's latents).
    `core` marks the attention core (split by tp: it works on heads), which selective
    recompute drops.
    """

    name: str
    elements: float
    bytes: float
    split: str
    core: bool = False


def norm_saved_tensors(model: ModelConfig, compute: int, where: str) -> list[Saved]:
    """RMSNorm (autotune_kernels.norm) saves its input and one fp32 root per token; its
    output is the input the following linears save. Under sequence parallel they read
    it all-gathered, but keep only the rank's sequence shard of it for backward and
    gather it again there (runtime/parallel/sp_saved.py, as Megatron-LM does)."""
    h = model.hidden_size
    return [Saved(f"{where} norm input", h, compute, "sp"),
            Saved(f"{where} norm rstd", 1, 4, "sp"),
            Saved(f"{where} norm output", h, compute, "sp")]


def block_saved_tensors(model: ModelConfig, moe: bool, compute: int, expert_parallel: bool = False) -> list[Saved]:
    """The runtime's Block (runtime/model.py, runtime/moe.py), item by item.

    Attention: RoPE saves only its cos/sin tables (counted per layer, not per token);
    fused SDPA saves q and k after RoPE, v, its output and the fp32 log-sum-exp, never
    seq x seq scores; its output, laid out (batch, seq, heads, dim), is wo's input as it
    is. SwiGLU saves gate, up and their product (silu(gate) is recomputed in backward:
    runtime/mlp.py's GatedActivation, as Megatron's fused SwiGLU). An MoE block saves the
    router's fp32 softmax, the top-k choices, their probabilities and sum (the
    renormalisation, top_k > 1) and the routing weights; the index of the permutation
    to expert order and of its inverse; each token's k copies dispatched to the experts,
    the experts' SwiGLU tensors (k per token) and their outputs; expert parallel adds
    the indices of its re-sort to local-expert order and back. Tensor parallel leaves
    MoE blocks whole ("full"): every tp rank routes the whole (gathered) sequence.
    """
    return (norm_saved_tensors(model, compute, "attention") + attention_saved_tensors(model, compute)
            + norm_saved_tensors(model, compute, "mlp") + mlp_saved_tensors(model, moe, compute, expert_parallel))


def windowed_fraction(model: ModelConfig) -> float:
    """The share of layers whose attention takes a band mask (a window shorter than the sequence)."""
    if model.sliding_window is None:  # most models: no loop over the layers on every estimate
        return 0.0
    masked = sum(1 for layer in range(model.num_layers)
                 if (w := model.window(layer)) is not None and w < model.seq_len)
    return masked / model.num_layers


def attention_widths(model: ModelConfig) -> tuple[int, int, int]:
    """(query width, key width, value width) per token of one layer's attention core: heads
    times their head dims (MLA: qk = nope + rope wide, v its own; every head has a key)."""
    qk, v = model_size.attention_head_dims(model)
    if model.attention == "mla":
        return model.num_heads * qk, model.num_heads * qk, model.num_heads * v
    return model.num_heads * qk, model.num_kv_heads * qk, model.num_kv_heads * v


def attention_saved_tensors(model: ModelConfig, compute: int) -> list[Saved]:
    """Fused SDPA saves q and k after RoPE, v, its output (wo's input) and the log-sum-exp.

    QK-norm saves the q and k it normalises and one fp32 root per head and token. MLA's
    low-rank projections run whole on every tensor-parallel rank (their latents are not
    split by heads): each latent's RMSNorm saves its input and root, and its output is
    the up projection's input; the shared RoPE key is saved before it is broadcast to
    the heads. Values narrower than keys are padded to the key width for the kernel."""
    q, k, v = attention_widths(model)
    items = [Saved("q after rope", q, compute, "tp"), Saved("k after rope", k, compute, "tp")]
    if v < k:
        # The fused kernels need values as wide as keys: MLA pads them (runtime/mla.py), and
        # the kernel keeps its padded output; wo keeps the output cut back to v's width.
        items += [Saved("v padded to the key width", k, compute, "tp"),
                  Saved("attention output, padded", q, compute, "tp", core=True)]
    else:
        items.append(Saved("v", v, compute, "tp"))
    items += [Saved("attention output (wo's input)", model.num_heads * model_size.attention_head_dims(model)[1],
                    compute, "tp"),
              Saved("log-sum-exp", model.num_heads, 4, "tp", core=True)]
    if model.qk_norm:
        heads = model.num_heads + model.num_kv_heads
        items += [Saved("qk-norm inputs", q + k, compute, "tp"), Saved("qk-norm rstd", heads, 4, "tp")]
    if model.attention == "mla":
        m = model.mla
        for latent, width in (("q", m.q_lora_rank), ("kv", m.kv_lora_rank)):
            if width:
                items += [Saved(f"{latent} latent norm input and output", 2 * width, compute, "full"),
                          Saved(f"{latent} latent norm rstd", 1, 4, "full")]
        items.append(Saved("shared rope key", m.qk_rope_head_dim, compute, "full"))
    return items


def mlp_saved_tensors(model: ModelConfig, moe: bool, compute: int, expert_parallel: bool) -> list[Saved]:
    h, per_width = model.hidden_size, mlp_saved_per_width(model)
    if not moe:
        return [Saved(f"mlp ({model.mlp}) intermediates", per_width * model.ffn_hidden_size, compute, "tp")]
    k, ef = model.moe.top_k, model.moe.expert_ffn_hidden_size
    mlp = [Saved("router probabilities (fp32)", model.moe.num_experts, 4, "full"),
           Saved("top-k choices (int64)", k, 8, "full"),
           Saved("routing weights", k, compute, "full"),
           Saved("permutation and inverse (int64)", 2 * k, 8, "full"),
           Saved("dispatched tokens", k * h, compute, "full"),
           Saved(f"expert ({model.mlp}) intermediates", per_width * k * ef, compute, "full"),
           Saved("expert outputs", k * h, compute, "full")]
    if k > 1:
        mlp.append(Saved("top-k probabilities and their sum (fp32)", k + 1, 4, "full"))
    if expert_parallel:
        mlp.append(Saved("local-expert sort and inverse (int64)", 2 * k, 8, "full"))
    if model.moe.num_shared_experts:
        mlp.append(Saved("shared experts", per_width * model.moe.num_shared_experts * ef, compute, "full"))
    return mlp


def mlp_saved_per_width(model: ModelConfig) -> int:
    """Tensors of the MLP's width an MLP saves: gated (SwiGLU, GeGLU) the gate, up and
    their product (down's input), the gate's activation recomputed in backward
    (runtime/mlp.py); GELU its input and output (down's input); squared ReLU the ReLU's
    output (its own backward and the square's input) and the square (down's input)."""
    return 3 if model.mlp in model_size.GATED_MLPS else 2


def op_saved_tensors(model: ModelConfig, moe: bool, compute: int, tp: int, expert_parallel: bool = False
                     ) -> list[Saved]:
    """Per-op recompute (runtime/parallel/recompute.py, torchtitan's policy) keeps a block's
    input, the outputs of its fused attention and tensor-parallel collectives, and of its
    matmuls in forward order the first, third, fifth...: wq, wv, and in a gated MLP up
    and down, in a plain one up (wk, wo and gate, or down, are recomputed with the norms,
    RoPE and the gating). An MoE block's parts count their own matmuls (the attention's
    as a dense block's, the shared experts' as an MLP's) and keep every routed-expert
    tensor and, under expert parallel, the token all-to-alls' outputs."""
    h = model.hidden_size
    q, k, v = attention_widths(model)
    items = [Saved("block input", h, compute, "sp"), Saved("q, v (wq, wv outputs)", q + v, compute, "tp"),
             Saved("attention output", model.num_heads * model_size.attention_head_dims(model)[1], compute, "tp"),
             Saved("log-sum-exp", model.num_heads, 4, "tp")]
    if tp > 1:
        items.append(Saved("wo's reduction", h, compute, "sp"))
    if moe:
        # By parts: each part's input is kept, so the norms' outputs and the residual
        # between attention and MLP are too; the routed experts keep every matmul output
        # (gate and up, not their product; the down projection's output besides the copy
        # the combine keeps).
        k, ef = model.moe.top_k, model.moe.expert_ffn_hidden_size
        items += [Saved("attention norm output", h, compute, "sp"), Saved("mlp norm input", h, compute, "sp"),
                  Saved("mlp norm output", h, compute, "sp")]
        for item in mlp_saved_tensors(model, True, compute, expert_parallel):
            if item.name.startswith("expert ("):
                item = dataclasses.replace(item, elements=(mlp_saved_per_width(model) - 1) * k * ef)
            if item.name != "shared experts":
                items.append(item)
        items.append(Saved("experts' down outputs", k * h, compute, "full"))
        if expert_parallel:  # the token all-to-alls' outputs, kept by the policy
            items.append(Saved("dispatch and combine all-to-all outputs", 2 * k * h, compute, "full"))
        if model.moe.num_shared_experts:
            width = model.moe.num_shared_experts * model.moe.expert_ffn_hidden_size
            items += [Saved(f"shared experts' {name}", elements, compute, "full")
                      for name, elements in kept_mlp_matmuls(model, width)]
    else:
        items += [Saved(f"mlp {name}", elements, compute, "tp" if name == "up" else "full")
                  for name, elements in kept_mlp_matmuls(model, model.ffn_hidden_size)]
        if tp > 1:
            items.append(Saved("down's reduction", h, compute, "sp"))
    return items


def kept_mlp_matmuls(model: ModelConfig, width: int) -> list[tuple[str, int]]:
    """The MLP outputs op recompute keeps, (name, elements per token), counting its matmuls
    on its own: gated up (1st) and down (3rd), gate (2nd) recomputed; plain up (1st), down
    (2nd) recomputed. In a dense block the attention's four matmuls come first, which
    leaves the same ones (5th and 7th; 5th)."""
    if model.mlp in model_size.GATED_MLPS:
        return [("up", width), ("down output", model.hidden_size)]
    return [("up", width)]


def op_recomputed_params(model: ModelConfig, moe: bool) -> float:
    """Parameters of one layer whose matmuls op recompute runs again in backward: wk, wo
    and (gated) gate or (plain) down, of the dense MLP or of the shared experts."""
    h = model.hidden_size
    q, k, _ = attention_widths(model)
    width = model.ffn_hidden_size if not moe else (
        model.moe.num_shared_experts * model.moe.expert_ffn_hidden_size if model.moe else 0)
    return h * k + q * h + h * width


@dataclass(frozen=True)
class SavedTotals:
    """Bytes per token of a list of saved tensors, by how tensor parallel splits them."""

    tp: float
    sp: float
    full: float
    core: float  # the part of `tp` that belongs to the attention core

    @classmethod
    def of(cls, items: list[Saved]) -> "SavedTotals":
        sums = {"tp": 0.0, "sp": 0.0, "full": 0.0}
        for item in items:
            sums[item.split] += item.elements * item.bytes
        return cls(core=sum(i.elements * i.bytes for i in items if i.core), **sums)

    def per_token(self, tp: int, sp: bool, drop_core: bool = False) -> float:
        """Bytes per token on one tensor-parallel rank."""
        return (self.tp - (self.core if drop_core else 0.0)) / tp + (self.sp / tp if sp else self.sp) + self.full


def saved_bytes_per_token(saved: SavedTotals, tp: int, sp: bool, recompute: str, block_input: float) -> float:
    """Bytes one layer keeps per token of a micro-batch until its backward, for recompute
    none (every item), selective (the attention core's items dropped) and full (only the
    block's input, `block_input` bytes per token, split like the residual stream). Per-op
    recompute keeps another list (op_saved_tensors)."""
    if recompute == "full":
        return block_input / tp if sp else block_input
    return saved.per_token(tp, sp, drop_core=recompute == "selective")


# -- what each pipeline rank holds -----------------------------------------------------------------

@dataclass(frozen=True)
class ModelFigures:
    """Per-model numbers read for every layout, computed once per model."""

    attention: float  # parameters of one layer's attention
    dense_mlp: float
    moe_dense: float  # router and shared experts of an MoE layer (not split by ep)
    moe_routed: float  # every routed expert of an MoE layer
    moe_active: float  # MoE parameters one token passes through (router, top-k, shared)
    moe_before: tuple[int, ...]  # moe_before[i]: MoE layers among layers 0..i-1
    flops_per_token: float
    attention_flops_per_token: float  # the cores' (model_size.attention_flops_per_token): a walk over the layers
    # memo of layer_bytes: (moe, compute bytes, ep?, tp, sp, mode) -> bytes per token
    saved: dict[tuple[Any, ...], float]
    shapes: dict[tuple[Any, ...], Any]  # memo of rank_shape: (pp, chunks, V schedule?, tp, sp, ep, rank) -> RankShape,
    # and of pipeline_shapes
    peaks: dict[tuple[Any, ...], Any]  # memo of _backward_peaks and of the slowest rank's micro-batch (estimate_time),
    # which layouts differing only in data parallel share


@per_model_object
def model_figures(model: ModelConfig) -> ModelFigures:
    moe_before = [0]
    for layer in range(model.num_layers):
        moe_before.append(moe_before[-1] + model.is_moe_layer(layer))
    moe = model.moe
    router = model_size.moe_router_params(model) if moe else 0
    figures = ModelFigures(
        attention=model.attention_params(), dense_mlp=model.dense_mlp_params(),
        moe_dense=router + moe.num_shared_experts * model.expert_params() if moe else 0,
        moe_routed=moe.num_experts * model.expert_params() if moe else 0,
        moe_active=router + (moe.top_k + moe.num_shared_experts) * model.expert_params() if moe else 0,
        moe_before=tuple(moe_before), flops_per_token=model.flops_per_token(),
        attention_flops_per_token=model_size.attention_flops_per_token(model), saved={}, shapes={}, peaks={})
    return figures


def layer_bytes(model: ModelConfig, moe: bool, c: int, expert_parallel: bool, tp: int, sp: bool,
                mode: str) -> float:
    """Bytes per token one layer keeps for its backward under a recompute mode (memoised)."""
    fig = model_figures(model)
    key = (moe, c, expert_parallel, tp, sp, mode)
    if key not in fig.saved:
        if mode == "op":
            fig.saved[key] = SavedTotals.of(op_saved_tensors(model, moe, c, tp, expert_parallel)).per_token(tp, sp)
        else:
            totals = SavedTotals.of(block_saved_tensors(model, moe, c, expert_parallel))
            fig.saved[key] = saved_bytes_per_token(totals, tp, sp, mode, model.hidden_size * c)
    return fig.saved[key]


def hybrid_layer_bytes(model: ModelConfig, kind: str, c: int, expert_parallel: bool, tp: int, sp: bool,
                       mode: str) -> float:
    """layer_bytes of one block of a hybrid model (estimate/mamba.py gives its items): its norm
    and its mixer, or under op recompute its input and the matmul outputs it keeps."""
    fig = model_figures(model)
    key = ("hybrid", kind, c, expert_parallel, tp, sp, mode)
    if key not in fig.saved:
        if mode == "op":
            items = [Saved("block input", model.hidden_size, c, "sp")] + mlp_saved_tensors(model, True, c,
                                                                                          expert_parallel) \
                if kind == "moe" else [Saved(*item) for item in mamba.op_kept_items(model, kind, c)]
            fig.saved[key] = SavedTotals.of(items).per_token(tp, sp)
        else:
            mixer = [Saved(*item) for item in mamba.mamba_saved_items(model, c)] if kind == "mamba" else \
                attention_saved_tensors(model, c) if kind == "attention" else \
                mlp_saved_tensors(model, kind == "moe", c, expert_parallel)
            totals = SavedTotals.of(norm_saved_tensors(model, c, kind) + mixer)
            fig.saved[key] = saved_bytes_per_token(totals, tp, sp, mode, model.hidden_size * c)
    return fig.saved[key]


def hybrid_backward_moment(model: ModelConfig, layout: Layout, c: int, shape: "RankShape", tokens: float,
                           recomputes: bool) -> tuple[float, float]:
    """(activations a recomputed block rebuilds, its backward's own bytes) at a hybrid rank's
    heaviest block backward: its last block (every activation still held) unless blocks are
    recomputed, where each is rebuilt and run back in turn, so the heaviest kind counts."""
    if not recomputes:
        return 0.0, mamba.block_backward_bytes(model, mamba.last_kind(model, layout, shape.rank), layout, c, tokens)
    ep, tp, sp = layout.ep > 1, layout.tp, bool(layout.sp)
    moments = []
    for kind in mamba.rank_kinds(model, layout, shape.rank):
        rebuilt = tokens * (hybrid_layer_bytes(model, kind, c, ep, tp, sp, "none")
                            - hybrid_layer_bytes(model, kind, c, ep, tp, sp, layout.recompute))
        moments.append((rebuilt, mamba.block_backward_bytes(model, kind, layout, c, tokens)))
    return max(moments, key=sum)


def stage_chunks(layout: Layout) -> int:
    """Pipeline stages (chunks of layers) each rank holds."""
    return layout.vpp if layout.pp > 1 else 1


def pipeline_shapes(model: ModelConfig, layout: Layout) -> tuple["RankShape", ...]:
    """What the pipeline ranks that can be the worst hold: the first, the last, and of
    the ranks between, for each layer count they hold, the one nearest the end where
    the schedule's counts are highest.

    Between the ends the split (stage_split.py) leaves a rank one of two layer counts.
    The micro-batches in flight fall from the first rank to the last, or stay where
    every micro-batch is in flight at once; under the split backwards the postponed
    weight steps rise with the rank while the micro-batches in flight stay or rise
    (peak_points). So among ranks with equal layers the first is the worst, or the
    last (up to the few sends a lowered schedule holds more on a rank with fewer
    micro-batches in flight). A middle rank can beat the first: it may hold a layer
    more while holding one micro-batch fewer."""
    fig = model_figures(model)
    key = ("ranks", layout.pp, stage_chunks(layout), layout.schedule, layout.tp, layout.sp, layout.ep)
    shapes = fig.shapes.get(key)
    if shapes is None:
        spans = stage_layers(model, stage_count(layout))
        layers = [sum(len(spans[s]) for s in rank_stage_ids(layout, r)) for r in range(layout.pp)]
        middle = range(1, layout.pp - 1)
        if SCHEDULES[layout.schedule].split_backward:
            middle = reversed(middle)
        chosen = {}
        for r in middle:
            chosen.setdefault(layers[r], r)
        ranks = sorted({0, layout.pp - 1, *chosen.values()})
        shapes = fig.shapes[key] = tuple(rank_shape(model, layout, r) for r in ranks)
    return shapes


class RankShape(NamedTuple):
    """What one pipeline rank holds: its layers, and its parameters after tensor and
    expert parallel, before FSDP shards them.

    TP splits q/k/v/o, gate/up/down, the embedding and the head by tp (Megatron's
    column/row plan, vocabulary-parallel embedding and head); norms and MoE blocks (the
    router, shared and routed experts) stay whole on every tp rank. EP gives each rank
    num_experts/ep routed experts. The runtime never ties the head to the embedding, so
    both count.
    """

    rank: int
    layers: int
    moe_layers: int
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the head
    dense_params: float  # FSDP shards these over dp_shard*cp
    expert_params: float  # ... and these over dp_shard*cp/ep
    root_params: float  # embedding, final norm, head
    head_params: float  # final norm and head: FSDP's root module (zero 3 keeps it gathered)
    largest_block: float
    receiving: int = 0  # stages that take activations from another stage (all but the first)
    sending: int = 0  # stages that hand activations on (all but the last)
    sending_across: int = 0  # ... to a stage on another rank
    receiving_across: int = 0  # stages fed by a stage on another rank
    postponed_elements: float = 0.0  # per token: output gradients a split backward keeps for a
    # weight step, of the rank's heaviest stage but the first (see weight_output_grads)
    stage_sizes: tuple[int, ...] = ()  # layers of each of the rank's stages

    @property
    def total_params(self) -> float:
        return self.dense_params + self.expert_params


def rank_shape(model: ModelConfig, layout: Layout, rank: int) -> RankShape:
    fig = model_figures(model)
    key = (layout.pp, stage_chunks(layout), SCHEDULES[layout.schedule].v_shape, layout.tp, layout.sp, layout.ep, rank)
    shape = fig.shapes.get(key)
    if shape is None:
        shape = fig.shapes[key] = _rank_shape(model, layout, rank)
    return shape


def _rank_shape(model: ModelConfig, layout: Layout, rank: int) -> RankShape:
    fig, tp, h = model_figures(model), layout.tp, model.hidden_size
    stages = rank_stage_ids(layout, rank)
    last_stage = stage_count(layout) - 1
    spans = stage_layers(model, last_stage + 1)
    moe_layers = sum(fig.moe_before[spans[s].stop] - fig.moe_before[spans[s].start] for s in stages)
    layers = sum(len(spans[s]) for s in stages)
    first, last = 0 in stages, last_stage in stages

    norms = 2 * model_size.norm_params(model, h)
    whole = model_size.unsplit_attention_params(model)
    attention = (fig.attention - whole) / tp + whole
    dense_block = attention + norms + fig.dense_mlp / tp
    moe_block = attention + norms + fig.moe_dense
    moe_experts = fig.moe_routed / layout.ep
    embedding = model.embedding_params() / tp
    head = 0.0 if model.tie_embeddings else embedding
    root = (embedding + model.learned_positions * h if first else 0.0) + \
        (model_size.norm_params(model, h) + head if last else 0.0)
    dense_layers = layers - moe_layers
    blocks, experts = dense_layers * dense_block + moe_layers * moe_block, moe_layers * moe_experts
    largest = max(dense_block if dense_layers else 0.0, moe_block + moe_experts if moe_layers else 0.0)
    if model.hybrid_pattern is not None:  # single-mixer blocks (estimate/mamba.py)
        blocks, experts, largest = mamba.rank_params(model, layout, rank)
    return RankShape(
        rank=rank, layers=layers, moe_layers=moe_layers, first=first, last=last,
        dense_params=blocks + root, expert_params=experts, root_params=root,
        head_params=h + embedding if last else 0.0, largest_block=largest,
        receiving=sum(s > 0 for s in stages), sending=sum(s < last_stage for s in stages),
        sending_across=sum(s < last_stage and s + 1 not in stages for s in stages),
        receiving_across=sum(s > 0 and s - 1 not in stages for s in stages),
        postponed_elements=max((weight_output_grads(model, layout, spans[s], s == last_stage)
                                for s in stages if s > 0), default=0.0),
        stage_sizes=tuple(len(spans[s]) for s in stages))


def full_recompute_layers(layout: Layout, shape: RankShape) -> int:
    """Layers of the rank recomputed in full: every layer, or with recompute_layers K the
    first K of each stage (runtime/parallel/recompute.py)."""
    if layout.recompute != "full":
        return 0
    if not layout.recompute_layers:
        return shape.layers
    return sum(min(layout.recompute_layers, n) for n in shape.stage_sizes)


def weight_output_grads(model: ModelConfig, layout: Layout, layers: range, last: bool) -> float:
    """Elements per token of the gradients at the outputs of a stage's weighted ops (the
    dY each weight gradient needs), which torch's split backward (stage_backward_input)
    captures for the later weight step: q, k, v and the MLP's first half split by tp;
    the row-parallel outputs whole; the norms' scaling split by tp under SP; the last
    stage's final norm too. (Its head's output gradient takes the place of the logits,
    which the input step frees: counted with the micro-batches waiting on the last
    stage.) MoE (whole under TP): the router and the experts' SwiGLU for top_k experts.
    Under SP without op or full recompute, each half's input, regathered from its shard
    by the input step (runtime/parallel/sp_saved.py), waits whole for the weight step."""
    tp, h = layout.tp, model.hidden_size
    stream = h / tp if layout.sp else h
    q, k, v = attention_widths(model)
    attention = (q + k + v) / tp + h + 2 * stream
    if layout.sp and tp > 1 and layout.recompute in ("none", "selective"):
        attention += 2 * h  # both halves' regathered inputs
    if model.attention == "mla":  # the down projections' outputs, whole on every tp rank
        attention += (model.mla.q_lora_rank or 0) + model.mla.kv_lora_rank + model.mla.qk_rope_head_dim
    first_half = model_size.mlp_matrices(model) - 1
    total = 0.0
    for layer in layers:
        if model.is_moe_layer(layer):
            moe = model.moe
            experts = moe.top_k + moe.num_shared_experts
            total += attention + moe.num_experts + experts * (first_half * moe.expert_ffn_hidden_size + h)
        else:
            total += attention + first_half * model.ffn_hidden_size / tp + h
    return total + (stream if last else 0.0)


def moe_layer_bytes(model: ModelConfig, layout: Layout) -> float:
    """What an MoE layer keeps per micro-batch besides its per-token tensors: the
    balance loss's fp32 counts per sequence and expert, the int32 offsets of its three
    grouped matmuls (recomputed under full recompute), and the int64 expert counts its
    backward records."""
    experts = model.moe.num_experts
    recorded = 8 * experts
    if layout.recompute == "full":
        return recorded
    return recorded + 4 * layout.mbs * experts + 3 * 4 * experts / layout.ep


# -- pipeline schedules ---------------------------------------------------------------------------

def chunks_in_flight(layout: Layout, microbatches: int, rank: int) -> int:
    """Most (stage, micro-batch) forward results a pipeline rank holds at once
    (autotune/plan/schedules.py: each schedule's count from torch's action lists)."""
    if layout.pp == 1:
        return 1
    return SCHEDULES[layout.schedule].in_flight(layout.pp, microbatches, stage_chunks(layout), rank)


def peak_points(layout: Layout, microbatches: int, rank: int) -> list[tuple[int, int]]:
    """(chunks in flight, postponed weight steps) at the moments where a pipeline rank can
    peak (autotune/plan/schedules.py); without PP, one micro-batch and nothing postponed."""
    if layout.pp == 1:
        return [(1, 0)]
    return SCHEDULES[layout.schedule].peak_points(layout.pp, microbatches, stage_chunks(layout), rank)


def reshards_after_forward(layout: Layout) -> bool:
    """zero 3 frees each block's gathered parameters after its forward, except under PP,
    where the runtime keeps them (FSDP2 reshard_after_forward=False) as zero 2 does."""
    return layout.zero == 3 and layout.pp == 1


# -- the state ------------------------------------------------------------------------------------

TERMS = ("params", "master_params", "grads", "optimizer", "gathered_params", "activations", "pipeline_buffers",
         "logits", "temporaries", "overhead")


class State(NamedTuple):
    """What a rank keeps from step to step (bytes), and how its data parallel holds it."""

    params: float
    master_params: float
    grads: float  # zero 0/1: the buffer, always; zero 2/3: the shards, once a micro-batch is reduced
    optimizer: float
    sharded: bool  # zero 2/3: FSDP
    total: float  # the rank's parameters (elements), before sharding


def state_of(layout: Layout, prec: Precision, shape: RankShape) -> State:
    """zero 0/1 (ddp.py): parameters in the compute dtype, an fp32 gradient buffer, fp32
    masters (in bf16 only: in fp32 the parameters are their own) and AdamW's states, the
    latter two sliced at zero 1 over dp_shard x cp (experts over dp_shard x cp / ep).
    zero 2/3 (FSDP2): fp32 shards of the parameters (the masters), the gradients and the
    states over dp_shard x cp (experts over dp_shard x cp / ep)."""
    total = shape.dense_params + shape.expert_params
    shards = layout.dp_shard * layout.cp
    sharded_elements = shape.dense_params / shards + shape.expert_params / max(1, shards // layout.ep)
    if layout.zero >= 2:  # FSDP's gradient shards are in the parameters' dtype, whatever it reduces in
        return State(prec.master * sharded_elements, 0.0, prec.master * sharded_elements,
                     prec.optimizer * sharded_elements, True, total)
    updated = sharded_elements if layout.zero == 1 else total
    master = prec.master * updated if prec.compute != prec.master else 0.0
    return State(prec.compute * total, master, prec.grad * total, prec.optimizer * updated, False, total)


def state_floor(model: ModelConfig, layout: Layout, device: str) -> float:
    """Bytes the heaviest pipeline rank's state alone takes (parameters, masters, gradients,
    optimizer state): no peak of the layout is below it, since the optimizer step holds all
    of it (rank_terms). `model` as trained (config.as_trained). A listing of every layout
    skips pricing those whose floor is over the budget: they cannot fit, whatever their
    activations."""
    memo = model_figures(model).peaks
    # What pipeline_shapes' parameters and state_of read, all of them state keys (the
    # enumeration asks the floor once per combination of those).
    key = ("floor", device, layout.tp, layout.pp, layout.vpp, layout.schedule, layout.cp, layout.ep,
           layout.dp_shard, layout.zero)
    floor = memo.get(key)
    if floor is None:
        prec = precision(model, device)
        floor = memo[key] = max(sum(state_of(layout, prec, shape)[:4]) for shape in pipeline_shapes(model, layout))
    return floor


def gathered_params(layout: Layout, prec: Precision, shape: RankShape) -> dict[str, float]:
    """FSDP's gathered parameters (compute dtype) at each backward peak: zero 2, and zero 3
    under PP, every unit (each is freed after its own backward); zero 3 the root (final
    norm and head, kept from forward to backward) at the loss's backward, and with it the
    last block and the one prefetched at the last layer's."""
    if layout.zero < 2:
        return {"loss_backward": 0.0, "layer_backward": 0.0}
    if reshards_after_forward(layout):
        return {"loss_backward": prec.compute * shape.head_params,
                "layer_backward": prec.compute * (shape.head_params + 2 * shape.largest_block)}
    return dict.fromkeys(("loss_backward", "layer_backward"), prec.compute * shape.total_params)


def overhead_bytes(model: ModelConfig, layout: Layout, device: str) -> float:
    """Token ids on the device: inputs and labels of every micro-batch of the step (on the
    CPU views of one [rows, seq + 1] tensor, on CUDA a copy of each), and under CP the
    head-tail shards of the current micro-batch's (int64, seq/cp each). Under PP the
    trainer cuts every micro-batch's shards first, and joins the step's inputs and its
    labels into one tensor each for torch's schedule to cut again (pp.py)."""
    rows = layout.mbs * layout.grad_accum(model)
    overhead = 8 * (model.seq_len + 1) * rows if device == "cpu" else \
        16 * model.seq_len * rows + CUDA_FIXED_OVERHEAD_BYTES
    shard_rows = rows if layout.pp > 1 else layout.mbs
    if layout.cp > 1:
        overhead += 16 * shard_rows * model.seq_len / layout.cp
    if layout.pp > 1:
        overhead += 16 * rows * model.seq_len / layout.cp
    return overhead


# -- the candidate peaks --------------------------------------------------------------------------

def rank_memory(model: ModelConfig, layout: Layout, device: str, shape: RankShape) -> dict[str, dict[str, float]]:
    """Bytes a pipeline rank holds at each candidate peak, by term: {phase: {term:
    bytes}} for the phases loss_backward (the rank with the head), layer_backward and
    optimizer_step; the largest is the rank's peak."""
    return {phase: dict(zip(TERMS, terms)) for phase, terms in rank_terms(model, layout, device, shape).items()}


def rank_terms(model: ModelConfig, layout: Layout, device: str, shape: RankShape) -> dict[str, tuple[float, ...]]:
    """rank_memory with each phase's bytes as a tuple in the order of TERMS (the
    estimator prices many ranks and keeps one)."""
    prec = precision(model, device)
    m = layout.grad_accum(model)
    state = state_of(layout, prec, shape)
    overhead = overhead_bytes(model, layout, device)
    gathered = gathered_params(layout, prec, shape)
    fig = model_figures(model)
    key = (id(shape), device, m, layout.mbs, layout.cp, layout.tp, layout.sp, layout.recompute,
           layout.recompute_layers, layout.schedule, layout.vpp, layout.pp, layout.zero,
           layout.dp_shard, layout.dp)  # shapes are memoised in fig.shapes: one object per shape
    varying = fig.peaks.get(key)
    if varying is None:
        points = peak_points(layout, m, shape.rank)
        varying = fig.peaks[key] = _backward_peaks(model, layout, prec, shape, state, points)
    phases = {phase: (state.params, state.master_params, grads, state.optimizer, gathered[phase], activations,
                      pipeline, logits, temporaries, overhead)
              for phase, (grads, activations, pipeline, logits, temporaries) in varying.items()}
    # The optimizer step: the gradients complete; zero 1 gathers the updated parameters a
    # bucket at a time (its own slice copied out, then the whole bucket).
    step_temporaries = 0.0
    if layout.zero == 1 and layout.dp_shard * layout.cp > 1:
        bucket = min(DDP_BUCKET_ELEMENTS, state.total)
        step_temporaries = prec.compute * bucket * (1 + 1 / (layout.dp_shard * layout.cp))
    if layout.zero < 2 and prec.grad != prec.master:
        # bf16 gradients: the fp32 copies of the slice's, from the reduction to the end of
        # AdamW's step, freed before the gather.
        step_temporaries = max(step_temporaries, prec.master * state.optimizer / prec.optimizer)
    phases["optimizer_step"] = (state.params, state.master_params, state.grads, state.optimizer, 0.0, 0.0,
                                _pipeline_held(model, layout, prec, shape), 0.0, step_temporaries, overhead)
    if layout.zero >= 2 and layout.pp > 1:
        # The step's one reduction (torch's perform_reduce_grad): unit by unit FSDP frees the
        # gathered parameters and copies the whole gradients into the reduce-scatter's
        # input; the first unit's copy comes while every other unit's are still held.
        first_unit = max(shape.root_params, shape.largest_block)
        phases["backward_end"] = (state.params, state.master_params, gradients_held(layout, prec, state, True),
                                  state.optimizer,
                                  prec.compute * (shape.total_params - first_unit), 0.0, 0.0, 0.0,
                                  prec.grad * first_unit, overhead)
    if layout.zero >= 2 and layout.pp == 1:
        # The backward's end: FSDP reduces the root (final norm, head) and the embedding
        # last, once their gradients are whole. Both units are gathered, both gradients
        # unsharded (compute dtype), and a reduce-scatter copies one into fp32 (its
        # reduce_dtype) before sending it.
        embedding = shape.root_params - shape.head_params
        phases["backward_end"] = (state.params, state.master_params, state.grads, state.optimizer,
                                  prec.compute * shape.root_params, 0.0, 0.0, 0.0,
                                  prec.compute * shape.root_params + prec.grad * max(shape.head_params, embedding),
                                  overhead)
    return phases


def _pipeline_extras(model: ModelConfig, layout: Layout, prec: Precision, shape: RankShape):
    """Bytes a pipeline rank holds at its backward peaks besides its layers' activations,
    as a function of (chunks in flight, postponed weight steps, whether a backward of the
    step has run before).

    Outputs: a stage keeps its output (which nothing on the stage saves) until the
    micro-batch's backward; a lowered schedule's send of it is freed then too. The
    gradients a lowered schedule sends backward live until a later message proves them
    arrived (runtime/parallel/pp_sends.py): at most the schedule's gradients_held of
    them, at most m per stage fed across (the count is the most over the step, priced
    at every peak). An unlowered schedule (GPipe, 1F1B) keeps some sends past that in
    its own locals (Schedule.sends_kept).
    Inputs: a received activation is the stage's input, the tensor its first layer's norm
    saves (counted there); receive buffers live only while a micro-batch is handed over
    (torch_compat.LeanPipelineStage). Split backwards keep, per postponed weight step,
    the output gradients of the stage's weighted ops (weight_output_grads)."""
    m, v = layout.grad_accum(model), stage_chunks(layout)
    boundary = boundary_bytes(model, layout, prec)
    schedule = SCHEDULES[layout.schedule]
    held, per_chunk = 0.0, shape.sending_across / v
    if schedule.lowered and shape.receiving_across:
        held = min(schedule.gradients_held(layout.pp, shape.rank), m * shape.receiving_across)
    postponed_bytes = layout.mbs * model.seq_len / layout.cp * shape.postponed_elements * prec.compute

    def extras(chunks: int, postponed: int, after_first: bool) -> float:
        kept = 0.0
        if after_first and not schedule.lowered:
            outputs, gradients = schedule.sends_kept(layout.pp, m, shape.rank, chunks)
            kept = outputs * per_chunk + gradients * shape.receiving_across
        return boundary * (held + kept + chunks * per_chunk) + postponed * postponed_bytes

    return extras


def _pipeline_held(model: ModelConfig, layout: Layout, prec: Precision, shape: RankShape) -> float:
    """What pipeline parallel keeps past the step's last backward: nothing (the schedule
    waits for its sends when the step ends; no receive buffer outlives its micro-batch)."""
    return 0.0


def boundary_bytes(model: ModelConfig, layout: Layout, prec: Precision) -> float:
    """One micro-batch's activations (or their gradient) at a stage boundary, per rank."""
    tokens = layout.mbs * model.seq_len / layout.cp
    return tokens * model.hidden_size * prec.compute / (layout.tp if layout.sp else 1)


def loss_bytes(model: ModelConfig, layout: Layout, prec: Precision) -> tuple[float, float]:
    """(logits, the most the loss adds to them) of one micro-batch on one rank: the logits in
    the compute dtype (vocabulary-split under TP), and the larger of what its forward and
    its backward work in (autotune_kernels.loss): forward the fp32 chunk, less its row
    maximum, exponentiated (in fp32 the chunk is the logits themselves); backward the
    logits' gradient, as large as they, and the fp32 chunk less the log-sum-exp (with the
    upcast chunk too in bf16). Forward wins where one chunk holds every row in bf16."""
    tokens = layout.mbs * model.seq_len / layout.cp
    vocab = model.vocab_size / layout.tp
    chunk = 4 * min(tokens, max(1, LOSS_CHUNK_ELEMENTS // vocab)) * vocab
    upcast = 0 if prec.compute == 4 else 1
    logits = tokens * vocab * prec.compute
    return logits, max((2 + upcast) * chunk, logits + (1 + upcast) * chunk)


class MicrobatchBytes(NamedTuple):
    """What one micro-batch puts on a pipeline rank at its backward peaks
    (_backward_peaks), independent of the schedule's counts and of the data-parallel state."""

    per_chunk: float  # saved activations of one (stage, micro-batch) chunk
    recomputed: float  # what recomputing the last layer rebuilds before its backward
    swiglu: float  # the last layer's MLP backward: the incoming gradient and what it makes
    swiglu_grad_kept: float  # ... where the down projection's weight gradient stays (FSDP's)
    logits: float
    loss_backward: float
    lse: float
    final_norm: float


def microbatch_bytes(model: ModelConfig, layout: Layout, prec: Precision, shape: RankShape) -> MicrobatchBytes:
    """MicrobatchBytes, memoised per shape and the keys it reads: a listing prices each
    against many schedules, micro-batch counts and ZeRO stages."""
    memo = model_figures(model).peaks
    key = ("microbatch", id(shape), prec, layout.mbs, layout.cp, layout.tp, layout.sp, layout.ep, layout.recompute,
           layout.recompute_layers, stage_chunks(layout))  # shapes are memoised: one object per shape
    figures = memo.get(key)
    if figures is None:
        figures = memo[key] = _microbatch_bytes(model, layout, prec, shape)
    return figures


def _microbatch_bytes(model: ModelConfig, layout: Layout, prec: Precision, shape: RankShape) -> MicrobatchBytes:
    tokens = layout.mbs * model.seq_len / layout.cp  # local tokens of one micro-batch
    sp, tp, c, h = bool(layout.sp), layout.tp, prec.compute, model.hidden_size
    expert_parallel = layout.ep > 1

    def per_token(mode: str) -> float:  # all of the rank's layers, one micro-batch, under `mode`
        if model.hybrid_pattern is not None:
            return sum(count * hybrid_layer_bytes(model, kind, c, expert_parallel, tp, sp, mode)
                       for kind, count in mamba.rank_kinds(model, layout, shape.rank).items())
        dense = shape.layers - shape.moe_layers
        total = dense * layer_bytes(model, False, c, False, tp, sp, mode) if dense else 0.0
        if shape.moe_layers:
            total += shape.moe_layers * layer_bytes(model, True, c, expert_parallel, tp, sp, mode)
        return total

    full_layers = full_recompute_layers(layout, shape)
    if layout.recompute == "full" and full_layers < shape.layers:  # recompute_layers K
        fraction = full_layers / shape.layers
        kept = fraction * per_token("full") + (1 - fraction) * per_token("none")
        recomputed_layers = full_layers
    else:
        kept = per_token(layout.recompute)
        recomputed_layers = shape.layers if layout.recompute != "none" else 0
    # RoPE's cos/sin tables, fp32 [seq, head_dim/2] each, per layer and micro-batch, where
    # the layer keeps them (not where it recomputes its whole block or its elementwise ops).
    rope_layers = shape.layers - full_layers
    if layout.recompute == "op":
        rope_layers = 0
    rope = rope_layers * model.seq_len / layout.cp * model_size.rope_head_dim(model) * 4
    # A sliding window's band mask: SDPA keeps it, [seq, seq] in the compute dtype, per
    # windowed layer and micro-batch (runtime/layers.py). Context parallel's ring masks
    # only chunk pairs, as temporaries.
    band_masks = rope_layers * windowed_fraction(model) * model.seq_len ** 2 * c if layout.cp == 1 else 0.0
    moe_fixed = shape.moe_layers * moe_layer_bytes(model, layout) if shape.moe_layers else 0.0
    per_chunk = (tokens * kept + rope + band_masks + moe_fixed) / stage_chunks(layout)
    recomputed = tokens * (per_token("none") - kept) / shape.layers if recomputed_layers else 0.0
    incoming = tokens * h / (tp if sp else 1) * c
    if shape.moe_layers == shape.layers:
        # The experts' SwiGLU runs on k rows per token, and one gradient covers a weight of
        # all local experts. By then the shared experts' backward has freed their saved
        # tensors and left their input's gradient to be summed with the router's and the
        # experts'; the combine's backward has freed its indices and routing weights (the
        # gradient of the expert outputs replaces their saved copy).
        moe = model.moe
        rows, ef = tokens * moe.top_k, moe.expert_ffn_hidden_size
        ffn_grad = rows * ef * c
        weight_grad = moe.num_experts / layout.ep * h * ef * c
        incoming -= rows * 8 + rows * c
        if moe.num_shared_experts:
            incoming += tokens * h * c - tokens * mlp_saved_per_width(model) * moe.num_shared_experts * ef * c
    else:
        ffn_grad, weight_grad = tokens * model.ffn_hidden_size / tp * c, h * model.ffn_hidden_size / tp * c
        # fp8: the down projection's backward GEMMs take 8-bit copies of its output gradient
        # (tokens x hidden, whole under TP), of its input (tokens x ffn/tp) and of its weight
        # (hidden x ffn/tp), with their scales, beside the bf16 tensors.
        ffn = model.ffn_hidden_size / tp
        incoming += (prec.cast + prec.scale) * (tokens * h + tokens * ffn + h * ffn) if prec.cast else 0.0
    logits, loss_backward = loss_bytes(model, layout, prec)
    # Then the head's backward: the logits' gradient, the head's weight gradient (a new
    # tensor: the data parallel's hook or FSDP's accumulation takes it after) and the
    # hidden states' gradient, in that order. With a vocabulary large next to the tokens
    # of a micro-batch, this is the moment. The logits themselves are freed by then but
    # under PP, where the schedule keeps the stage's output until its backward is done
    # (the phase counts the logits apart: here only what exceeds them).
    head_backward = logits + c * (model.vocab_size / tp * h + tokens * h) - (logits if layout.pp == 1 else 0.0)
    loss_backward = max(loss_backward, head_backward)
    lse = 4 * tokens
    final_norm = tokens * SavedTotals.of(norm_saved_tensors(model, c, "final")).per_token(tp, sp) if shape.last \
        else 0.0
    swiglu, swiglu_kept = incoming + max(weight_grad + ffn_grad, 2 * ffn_grad), incoming + weight_grad + 2 * ffn_grad
    if model.hybrid_pattern is not None:  # the backward of a hybrid rank's heaviest block (estimate/mamba.py)
        recomputed, swiglu = hybrid_backward_moment(model, layout, c, shape, tokens, recomputed_layers > 0)
        swiglu_kept = swiglu
    return MicrobatchBytes(per_chunk, recomputed, swiglu, swiglu_kept, logits, loss_backward,
                           lse, final_norm)


def gradients_held(layout: Layout, prec: Precision, state: State, after_first: bool) -> float:
    """Gradients a rank holds during a backward: zero 0/1's buffer, always; FSDP's shards
    once a micro-batch's have been reduced in this step. Under PP FSDP reduces once, after
    the stage's last backward (torch's schedules turn its reduction off for every
    micro-batch, runtime/parallel/pp.py, as in torchtitan): from a stage's first backward
    to then it holds the stage's whole gradients in the reduce dtype, and no shard (the
    optimizer step sets them to None)."""
    if not state.sharded:
        return state.grads
    if not after_first:
        return 0.0
    return prec.grad * state.total if layout.pp > 1 else state.grads


def _backward_peaks(model: ModelConfig, layout: Layout, prec: Precision, shape: RankShape, state: State,
                    points: list[tuple[int, int]]) -> dict[str, tuple[float, ...]]:
    """(grads, activations, pipeline buffers, logits, temporaries) of a pipeline rank at the
    peaks of a backward pass, the heaviest over its peak points (chunks in flight,
    postponed weight steps):

    loss_backward (the rank with the head): every activation saved, the final norm's
      tensors, the logits, their gradient and the loss's fp32 chunks.
    layer_backward: the loss's buffers freed (under FSDP without PP the head's whole
      gradient kept: its unit, the root, reduces last), the last layer's SwiGLU backward holds the
      incoming gradient, then the down projection's weight gradient (a moment, until the
      gradient hook has added it into the buffer; FSDP keeps it, with the rest of the
      block's, until the block's reduce-scatter) and the product's gradient (tokens x
      ffn), then one tokens x ffn gradient more than the tensors it frees (two gradients
      made, the product freed). Recompute rebuilds that layer first. On the first stage
      the embedding's backward, its weight gradient beside the hidden states', can be
      heavier.
    Gradients: gradients_held.
    Under PP: micro-batches whose backward has not started keep, on the last stage, the
    final norm's saved tensors and their logits (the schedule keeps each stage's output
    until its backward). A stage but the last keeps its output for each micro-batch in
    flight (_pipeline_extras). Chunks in flight spread evenly over the rank's stages, but
    for the last stage of a V schedule, which holds one.
    """
    per_chunk, recomputed, swiglu_added, swiglu_kept, logits, loss_backward, lse, final_norm = \
        microbatch_bytes(model, layout, prec, shape)
    c, m, v = prec.compute, layout.grad_accum(model), stage_chunks(layout)
    peaks: dict[str, tuple[float, ...]] = {}

    def keep(phase: str, *terms: float) -> None:
        if phase not in peaks or sum(terms) > sum(peaks[phase]):
            peaks[phase] = terms

    extras = _pipeline_extras(model, layout, prec, shape) if layout.pp > 1 else lambda *moment: 0.0
    for point_chunks, postponed in points:
        # A point with every chunk of the step in flight is the rank's first backward: no
        # gradient yet. One backward later it holds one chunk less, and the gradients.
        moments = [(point_chunks, m * v > point_chunks)]
        if point_chunks == m * v > 1:
            moments.append((point_chunks - 1, True))
        for chunks, after_first in moments:
            grads = gradients_held(layout, prec, state, after_first)
            # The down projection's weight gradient is a new tensor that zero 0/1's hook, or
            # FSDP's accumulation under PP after the first backward, adds into what is held;
            # otherwise FSDP keeps it with the rest of the block's until their reduction.
            swiglu = swiglu_kept if state.sharded and (layout.pp == 1 or not after_first) else swiglu_added
            stored = chunks * per_chunk
            pipeline = extras(chunks, postponed, after_first)
            if shape.first:
                # The embedding's backward ends the micro-batch's: its weight gradient (a
                # new tensor, as the head's) beside the hidden states' gradient and, under PP,
                # the gradient the stage received (it lives through the stage's backward).
                keep("layer_backward", grads, stored - per_chunk, pipeline, 0.0,
                     c * (shape.root_params - shape.head_params)
                     + boundary_bytes(model, layout, prec) * (2 if layout.pp > 1 else 1))
            if not shape.last:
                keep("layer_backward", grads, stored + recomputed, pipeline, 0.0, swiglu)
            elif layout.pp == 1:
                # FSDP reduces the root's gradients (final norm, head) only when the whole
                # backward ends: the head's unsharded gradient lives through every layer's.
                head_grad = c * shape.head_params if state.sharded else 0.0
                keep("layer_backward", grads, stored + recomputed, pipeline, 0.0, swiglu + head_grad)
                keep("loss_backward", grads, stored + final_norm, pipeline, logits + lse, loss_backward)
            else:
                # V schedules run the last stage's backward right after its forward. Under a
                # split backward the others have had their input step, which frees the logits
                # and keeps the head's output gradient instead (as large).
                schedule = SCHEDULES[layout.schedule]
                waiting = 0 if schedule.v_shape else max(1, chunks // v) - 1
                saved = waiting * (final_norm + logits + (0.0 if schedule.split_backward else lse))
                keep("layer_backward", grads, stored + recomputed + saved, pipeline, logits, swiglu)
                keep("loss_backward", grads, stored + final_norm + saved, pipeline, logits + lse, loss_backward)
    return peaks
