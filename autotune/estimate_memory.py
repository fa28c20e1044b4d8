"""Peak memory of one rank for a layout: what our runtime keeps, term by term.

Precision (`device`): on the CPU everything is fp32 (parameters are their own
masters, AdamW keeps two fp32 states, activations fp32); on CUDA parameters,
gradients and AdamW states are fp32, compute runs in the model's dtype (bf16) on a
working copy of the parameters (FSDP2 mixed precision) and gradients are reduced in
fp32: 4 + 4 + 8 = 16 bytes per parameter before sharding, plus the working copy.

The peak is the largest of three moments of a step (see rank_memory):
- the loss's backward: every in-flight activation held and cross_entropy's
  vocabulary-sized fp32 buffers alive;
- the last layer's backward: the loss's buffers freed, SwiGLU's gradients alive;
- the optimizer step: gradients complete, AdamW's temporaries.
From the second micro-batch on, the backward moments also hold FSDP2's unsharded fp32
gradients, since the trainer syncs gradients on the last micro-batch only.

Context parallel divides every per-token term by cp: each rank holds seq_len/cp
tokens of each sequence, and ring attention saves what fused attention saves (q, k,
v, output, log-sum-exp) for its own tokens only. The ring's buffers (the KV block in
flight, fp32 dK/dV and dQ accumulators) live only inside one layer's attention; in
backward they come after that layer's MLP backward has freed its saved tensors and
SwiGLU's gradients, and they are not modelled as a peak of their own (no measured
layout peaks there: benchmarks/estimator_accuracy.md).

Activations are the tensors autograd saves, itemised per layer for our Llama block
in the accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"): the same items with the paper's GPT block give its
sbh(34 + 5as/h), and its TP, SP and recompute adjustments. Against the CPU runtime
(benchmarks/estimator_accuracy.md) the peak is within a few hundred bytes of the
measured bytes of live tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autotune.config import ModelConfig
from autotune.errors import UsageError
from autotune.layout import Layout
from autotune.schedules import SCHEDULES
from autotune.stage_split import rank_stage_ids, stage_count, stage_layers

DEVICES = ("cpu", "cuda")
# Bytes the CUDA allocator hands out besides the model's tensors: cuBLAS workspaces and
# small buffers. The CUDA context and NCCL's buffers are outside the allocator, as they
# are outside the measured peak (the allocator's statistics).
CUDA_FIXED_OVERHEAD_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor the runtime keeps."""

    master: int  # parameters as the optimizer sees them
    grad: int  # gradients, reduced and accumulated
    optimizer: int  # AdamW exp_avg + exp_avg_sq
    compute: int  # activations and the working copy of the parameters


# By the precision the model trains in (estimate() gives the model its trained dtype).
_PRECISIONS = {"bf16": Precision(master=4, grad=4, optimizer=8, compute=2),
               "fp32": Precision(master=4, grad=4, optimizer=8, compute=4)}


def precision(model: ModelConfig, device: str) -> Precision:
    if device not in DEVICES:
        raise UsageError(f"device: must be one of {', '.join(DEVICES)}, got {device!r}")
    return _PRECISIONS[model.dtype]


# -- activations: what autograd saves, per token of a micro-batch ------------------------------

@dataclass(frozen=True)
class Saved:
    """One tensor autograd keeps for the backward pass, counted per token.

    `split` says how tensor parallel divides it: "tp" always (heads, MLP columns);
    "sp" only with sequence parallel (the residual stream and norms); "full" never
    (the all-gathered input that a column-parallel linear saves under torch's
    sequence parallel). `core` marks the attention core (split by tp: it works on
    heads), which selective recompute drops.
    """

    name: str
    elements: float
    bytes: float
    split: str
    core: bool = False


def norm_saved_tensors(model: ModelConfig, compute: int, where: str) -> list[Saved]:
    """RMSNorm (runtime/model.py) upcasts to fp32: `x.float()` is saved by pow and mul,
    with the rsqrt [tokens, 1]; the normalized tensor is saved by `* weight`; the norm's
    output is the input the following linears save, all-gathered first under sequence
    parallel (torch's SequenceParallel), so it is never split."""
    h = model.hidden_size
    return [Saved(f"{where} norm input (fp32)", h, 4, "sp"),
            Saved(f"{where} norm rsqrt", 1, 4, "sp"),
            Saved(f"{where} normalized", h, compute, "sp"),
            Saved(f"{where} input (norm output)", h, compute, "full")]


def block_saved_tensors(model: ModelConfig, moe: bool, compute: int, expert_parallel: bool = False) -> list[Saved]:
    """The runtime's Block (runtime/model.py, runtime/moe.py), item by item.

    Attention: RoPE saves only its cos/sin tables (counted per layer, not per token);
    fused SDPA saves q and k after RoPE, v, its output (also wo's input) and the fp32
    log-sum-exp, never seq x seq scores. SwiGLU saves gate, silu(gate), up and their
    product. An MoE block saves the router's fp32 softmax, the top-k choices, their
    probabilities and sum (the renormalisation, top_k > 1) and the routing weights; the
    index of the permutation to expert order and of its inverse; each token's k
    copies dispatched to the experts, the experts' SwiGLU tensors (k per token) and
    their outputs; expert parallel adds the indices of its re-sort to local-expert
    order and back. Tensor parallel leaves MoE blocks whole ("full"): every tp rank
    routes the whole (gathered) sequence.
    """
    h = model.hidden_size
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    attention = [Saved("q after rope", q, compute, "tp"), Saved("k after rope", kv, compute, "tp"),
                 Saved("v", kv, compute, "tp"), Saved("attention output", q, compute, "tp"),
                 Saved("log-sum-exp", model.num_heads, 4, "tp", core=True)]
    if moe:
        k, ef = model.moe.top_k, model.moe.expert_ffn_hidden_size
        mlp = [Saved("router probabilities (fp32)", model.moe.num_experts, 4, "full"),
               Saved("top-k choices (int64)", k, 8, "full"),
               Saved("routing weights", k, compute, "full"),
               Saved("permutation and inverse (int64)", 2 * k, 8, "full"),
               Saved("dispatched tokens", k * h, compute, "full"),
               Saved("expert gate, silu, up, product", 4 * k * ef, compute, "full"),
               Saved("expert outputs", k * h, compute, "full")]
        if k > 1:
            mlp.append(Saved("top-k probabilities and their sum (fp32)", k + 1, 4, "full"))
        if expert_parallel:
            mlp.append(Saved("local-expert sort and inverse (int64)", 2 * k, 8, "full"))
        if model.moe.num_shared_experts:
            mlp.append(Saved("shared experts", 4 * model.moe.num_shared_experts * ef, compute, "full"))
    else:
        mlp = [Saved("mlp gate, silu, up, product", 4 * model.ffn_hidden_size, compute, "tp")]
    return (norm_saved_tensors(model, compute, "attention") + attention
            + norm_saved_tensors(model, compute, "mlp") + mlp)


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


def saved_bytes_per_token(saved: SavedTotals, tp: int, sp: bool, recompute: str, block_input: float) -> float:
    """Bytes one layer keeps per token of a micro-batch until its backward.

    none: every item; selective: the attention core's items dropped (recomputed);
    full: only the block's input (`block_input` bytes per token, split like the
    residual stream: by tp under sequence parallel), the block being recomputed.
    """
    if recompute == "full":
        return block_input / tp if sp else block_input
    core = saved.core if recompute == "selective" else 0.0
    return (saved.tp - core) / tp + (saved.sp / tp if sp else saved.sp) + saved.full


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
    saved: dict  # (moe layer?, compute bytes, expert parallel?) -> SavedTotals of a block; also
    # a memo of saved_bytes_per_token: (moe layer?, compute bytes, expert parallel?, tp, sp, recompute) -> bytes
    final_norm: dict  # compute bytes -> SavedTotals of the final norm
    shapes: dict  # memo of rank_shape: (pp, chunks, V schedule?, tp, sp, ep, rank) -> RankShape,
    # and of pipeline_shapes
    peaks: dict  # memo of _backward_peaks and of the slowest rank's micro-batch (estimate_time),
    # which layouts differing only in data parallel share


_FIGURES: dict[int, tuple[ModelConfig, ModelFigures]] = {}


def model_figures(model: ModelConfig) -> ModelFigures:
    cached = _FIGURES.get(id(model))
    if cached and cached[0] is model:
        return cached[1]
    moe_before = [0]
    for layer in range(model.num_layers):
        moe_before.append(moe_before[-1] + model.is_moe_layer(layer))
    moe = model.moe
    router = model.hidden_size * moe.num_experts if moe else 0
    figures = ModelFigures(
        attention=model.attention_params(), dense_mlp=model.dense_mlp_params(),
        moe_dense=router + moe.num_shared_experts * model.expert_params() if moe else 0,
        moe_routed=moe.num_experts * model.expert_params() if moe else 0,
        moe_active=router + (moe.top_k + moe.num_shared_experts) * model.expert_params() if moe else 0,
        moe_before=tuple(moe_before), flops_per_token=model.flops_per_token(),
        saved={(is_moe, c, ep): SavedTotals.of(block_saved_tensors(model, is_moe, c, ep))
               for is_moe in ((False, True) if moe else (False,)) for c in (2, 4) for ep in (False, True)},
        final_norm={c: SavedTotals.of(norm_saved_tensors(model, c, "final")) for c in (2, 4)}, shapes={}, peaks={})
    if len(_FIGURES) > 64:
        _FIGURES.clear()
    _FIGURES[id(model)] = (model, figures)
    return figures


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
    root_params: float  # embedding, final norm, head: FSDP's root module
    largest_block: float
    largest_tensor: float  # of the dense parameters
    largest_expert_tensor: float  # one stacked expert weight, [experts/ep, hidden, ffn]
    receiving: int = 0  # stages that take activations from another stage (all but the first)
    sending: int = 0  # stages that hand activations on (all but the last)
    sending_across: int = 0  # ... to a stage on another rank
    receiving_across: int = 0  # stages fed by a stage on another rank
    postponed_elements: float = 0.0  # per token: output gradients a split backward keeps for a
    # weight step, of the rank's heaviest stage but the first (see weight_output_grads)


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

    dense_block = fig.attention / tp + 2 * h + fig.dense_mlp / tp
    moe_block = fig.attention / tp + 2 * h + fig.moe_dense
    moe_experts = fig.moe_routed / layout.ep
    embedding = model.embedding_params() / tp
    root = (embedding if first else 0.0) + (h + embedding if last else 0.0)
    dense_layers = layers - moe_layers
    dense_tensors = [embedding if root else 0.0, h * model.num_heads * model.head_dim / tp]
    if dense_layers:
        dense_tensors.append(h * model.ffn_hidden_size / tp)
    if moe_layers:  # the router, the shared experts
        moe = model.moe
        dense_tensors.append(h * max(moe.num_experts, moe.num_shared_experts * moe.expert_ffn_hidden_size))
    return RankShape(
        rank=rank, layers=layers, moe_layers=moe_layers, first=first, last=last,
        dense_params=dense_layers * dense_block + moe_layers * moe_block + root,
        expert_params=moe_layers * moe_experts, root_params=root,
        largest_block=max(dense_block if dense_layers else 0.0, moe_block + moe_experts if moe_layers else 0.0),
        largest_tensor=max(dense_tensors),
        largest_expert_tensor=moe_experts / 3 if moe_layers else 0.0,
        receiving=sum(s > 0 for s in stages), sending=sum(s < last_stage for s in stages),
        sending_across=sum(s < last_stage and s + 1 not in stages for s in stages),
        receiving_across=sum(s > 0 and s - 1 not in stages for s in stages),
        postponed_elements=max((weight_output_grads(model, layout, spans[s], s == last_stage)
                                for s in stages if s > 0), default=0.0))


def weight_output_grads(model: ModelConfig, layout: Layout, layers: range, last: bool) -> float:
    """Elements per token of the gradients at the outputs of a stage's weighted ops (the
    dY each weight gradient needs), which torch's split backward (stage_backward_input)
    captures for the later weight step: q, k, v and the MLP's first half split by tp;
    the row-parallel outputs whole; the norms' scaling split by tp under SP; the last
    stage's final norm too. (Its head's output gradient takes the place of the logits,
    which the input step frees: counted with the micro-batches waiting on the last
    stage.) MoE (whole under TP): the router and the experts' SwiGLU for top_k experts."""
    tp, h = layout.tp, model.hidden_size
    stream = h / tp if layout.sp else h
    attention = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim / tp + h + 2 * stream
    total = 0.0
    for layer in layers:
        if model.is_moe_layer(layer):
            moe = model.moe
            experts = moe.top_k + moe.num_shared_experts
            total += attention + moe.num_experts + experts * (2 * moe.expert_ffn_hidden_size + h)
        else:
            total += attention + 2 * model.ffn_hidden_size / tp + h
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
    (autotune/schedules.py: each schedule's count from torch's action lists)."""
    if layout.pp == 1:
        return 1
    return SCHEDULES[layout.schedule].in_flight(layout.pp, microbatches, stage_chunks(layout), rank)


def peak_points(layout: Layout, microbatches: int, rank: int) -> list[tuple[int, int]]:
    """(chunks in flight, postponed weight steps) at the moments where a pipeline rank can
    peak (autotune/schedules.py); without PP, one micro-batch and nothing postponed."""
    if layout.pp == 1:
        return [(1, 0)]
    return SCHEDULES[layout.schedule].peak_points(layout.pp, microbatches, stage_chunks(layout), rank)


def reshards_after_forward(layout: Layout) -> bool:
    """zero 3 frees each block's gathered parameters after its forward, except under PP,
    where the runtime keeps them (FSDP2 reshard_after_forward=False) as zero 2 does."""
    return layout.zero == 3 and layout.pp == 1


# -- the candidate peaks --------------------------------------------------------------------------

TERMS = ("params", "grads", "optimizer", "optimizer_temp", "activations", "fsdp_buffers", "pipeline_buffers",
         "logits", "overhead")


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
    total = shape.dense_params + shape.expert_params
    dense_shard = layout.dp_shard * layout.cp if layout.zero >= 1 else 1
    expert_shard = max(1, dense_shard // layout.ep)
    sharded = shape.dense_params / dense_shard + shape.expert_params / expert_shard

    # State after a step; FSDP shards dense parameters over dp_shard*cp, experts over
    # dp_shard*cp/ep:  zero 0 nothing;  zero 1 AdamW states;  zero 2 gradients and
    # states;  zero 3 parameters too.
    param_bytes = prec.master * (sharded if layout.zero >= 2 else total)
    optim_bytes = prec.optimizer * (sharded if layout.zero >= 1 else total)
    grads_after_step = prec.grad * (sharded if layout.zero >= 2 else total)

    # FSDP2's unsharded working copy in the compute dtype. The runtime wraps the model
    # only when dp*cp > 1; replicate (zero 0/1) then keeps the copy for good, zero 2
    # gathers it for forward and backward, zero 3 holds the root module, the block in
    # use and the one prefetched. On CUDA a bf16 copy exists whatever the layout.
    if reshards_after_forward(layout):
        working = prec.compute * (shape.root_params + 2 * shape.largest_block)
    elif layout.dp * layout.cp > 1 or prec.compute != prec.master:
        working = prec.compute * total
    else:
        working = 0.0

    # Token ids on the device: inputs and labels of every micro-batch of the step, and
    # under CP the head-tail shards of the current micro-batch's (int64, seq/cp each).
    rows = layout.mbs * m
    overhead = 8 * (model.seq_len + 1) * rows if device == "cpu" else \
        16 * model.seq_len * rows + CUDA_FIXED_OVERHEAD_BYTES
    if layout.cp > 1:
        overhead += 16 * layout.mbs * model.seq_len / layout.cp

    # AdamW's temporaries: the foreach kernels (CUDA) build sqrt(exp_avg_sq) for every
    # local tensor at once; the CPU's single-tensor loop makes two of one tensor at a time.
    if device == "cuda":
        temp = 4 * (sharded if layout.zero >= 1 else total)
    else:
        temp = 2 * 4 * max(shape.largest_tensor / dense_shard, shape.largest_expert_tensor / expert_shard)
    # torch's PipelineStage allocates, once for the run, a receive buffer per micro-batch
    # for the activations of each stage but the first and for the gradients of each
    # stage but the last ([micro-batch, seq/cp, hidden] in the compute dtype, split by
    # tp under SP). A stage fed by a stage on the same rank (V schedules) keeps that
    # stage's outputs in its buffers instead: the same bytes.
    pipeline = m * (shape.receiving + shape.sending) * boundary_bytes(model, layout, prec)
    # By the last layer's backward the head has its gradients, if none were there yet.
    head_grads = prec.grad * (model.hidden_size + model.embedding_params() / layout.tp) if shape.last else 0.0
    # Between micro-batches FSDP2 keeps unsharded fp32 gradients (the trainer syncs on the
    # last micro-batch only); a backward reaches its peak with them only if an earlier
    # backward ran in this step.
    fig = model_figures(model)
    key = (id(shape), device, m, layout.mbs, layout.cp, layout.tp, layout.sp, layout.recompute, layout.schedule,
           layout.vpp, layout.pp)  # shapes are memoised in fig.shapes: one object per shape
    varying = fig.peaks.get(key)
    if varying is None:
        varying = fig.peaks[key] = _backward_peaks(model, layout, prec, shape, peak_points(layout, m, shape.rank),
                                                   full_grads=prec.grad * total, head_grads=head_grads)
    phases = {phase: (param_bytes, grads, optim_bytes, 0.0, activations, working, pipeline, logits, overhead)
              for phase, (grads, activations, logits) in varying.items()}
    phases["optimizer_step"] = (param_bytes, grads_after_step, optim_bytes, temp, 0.0,
                                working if layout.zero <= 1 else 0.0, pipeline, 0.0, overhead)
    return phases


def _pipeline_extras(model: ModelConfig, layout: Layout, prec: Precision, shape: RankShape):
    """Bytes a pipeline rank holds at its backward peaks besides its layers' activations,
    as a function of (chunks in flight, postponed weight steps).

    Outputs: a stage keeps its output (which nothing on the stage saves) until the
    micro-batch's backward. torch's lowered schedules also keep every tensor they send,
    activations forward and gradients backward, until the step ends; by the rank's last
    peak it has sent all of a step's micro-batches but the backwards of those still in
    flight: m * (stages sending across + stages fed across) - chunks * (fed across) / v.
    Inputs: in fp32 a stage's receive buffer is the tensor its first layer's norm saves,
    already counted (pipeline_buffers). Split backwards keep, per postponed weight step,
    the output gradients of the stage's weighted ops (weight_output_grads)."""
    m, v = layout.grad_accum(model), stage_chunks(layout)
    boundary = boundary_bytes(model, layout, prec)
    if SCHEDULES[layout.schedule].lowered:
        held, per_chunk = m * (shape.sending_across + shape.receiving_across), -shape.receiving_across / v
    else:
        held, per_chunk = 0.0, shape.sending_across / v
    if prec.compute == 4:
        per_chunk -= shape.receiving / v
    postponed_bytes = layout.mbs * model.seq_len / layout.cp * shape.postponed_elements * prec.compute
    return lambda chunks, postponed: boundary * (held + chunks * per_chunk) + postponed * postponed_bytes


def boundary_bytes(model: ModelConfig, layout: Layout, prec: Precision) -> float:
    """One micro-batch's activations (or their gradient) at a stage boundary, per rank."""
    tokens = layout.mbs * model.seq_len / layout.cp
    return tokens * model.hidden_size * prec.compute / (layout.tp if layout.sp else 1)


def _backward_peaks(model: ModelConfig, layout: Layout, prec: Precision, shape: RankShape,
                    points: list[tuple[int, int]], full_grads: float, head_grads: float
                    ) -> dict[str, tuple[float, float, float]]:
    """(gradients, activations, loss buffers) of a pipeline rank at the peaks of a backward
    pass, the heaviest over its peak points (chunks in flight, postponed weight steps):

    loss_backward (the rank with the head): every activation saved, and cross_entropy's
      buffers. It runs on fp32 logits (split by tp under loss_parallel): log_softmax
      saves its fp32 output, and its backward holds that, the incoming gradient and its
      result at once, 12 bytes per token and vocabulary entry.
    layer_backward: the head's buffers freed, the last layer's SwiGLU backward holds the
      incoming gradient, then the down projection's weight gradient and the product's
      gradient (tokens x ffn), then two tokens x ffn gradients more than the tensors it
      frees. With gradients accumulating from earlier micro-batches (`full_grads` held)
      the fresh weight gradient is a temporary that AccumulateGrad adds and frees at
      once; without, it becomes .grad and stays (and the head's, `head_grads`, are
      there). Recompute rebuilds that layer first.
    Under PP: micro-batches whose backward has not started keep, on the last stage, the
    final norm's saved tensors, their log_softmax output and the logits (the schedule
    keeps each stage's output until its backward, so the current micro-batch's logits
    stay too, through the whole backward of the stage). A stage but the last keeps its
    output (the last layer's, which nothing on this stage saves) for each micro-batch in
    flight; a stage but the first takes its input in a receive buffer (pipeline_buffers),
    which in fp32 is the very tensor its first layer's norm saves, so it is not counted
    twice. Chunks in flight spread evenly over the rank's stages, but for the last stage
    of a V schedule, which holds one.
    """
    fig = model_figures(model)
    tokens = layout.mbs * model.seq_len / layout.cp  # local tokens of one micro-batch
    sp, tp, c, h = bool(layout.sp), layout.tp, prec.compute, model.hidden_size
    block_input = h * c  # saved by full recompute's checkpoint

    expert_parallel = layout.ep > 1

    def layer(moe: bool, recompute: str) -> float:
        key = (moe, c, moe and expert_parallel, tp, sp, recompute)
        if key not in fig.saved:
            fig.saved[key] = saved_bytes_per_token(fig.saved[key[:3]], tp, sp, recompute, block_input)
        return fig.saved[key]

    def per_token(recompute: str) -> float:  # all of the rank's layers, one micro-batch
        dense = shape.layers - shape.moe_layers
        total = dense * layer(False, recompute) if dense else 0.0
        if shape.moe_layers:
            total += shape.moe_layers * layer(True, recompute)
        return total

    kept = per_token(layout.recompute)
    # RoPE's cos/sin tables, fp32 [seq, head_dim/2] each, per layer and micro-batch.
    rope = 0.0 if layout.recompute == "full" else shape.layers * model.seq_len / layout.cp * model.head_dim * 4
    moe_fixed = shape.moe_layers * moe_layer_bytes(model, layout) if shape.moe_layers else 0.0
    per_chunk = (tokens * kept + rope + moe_fixed) / stage_chunks(layout)
    recomputed = tokens * (per_token("none") - kept) / shape.layers
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
        weight_grad = moe.num_experts / layout.ep * h * ef * prec.grad
        incoming -= rows * 8 + rows * c
        if moe.num_shared_experts:
            incoming += tokens * h * c - tokens * 4 * moe.num_shared_experts * ef * c
    else:
        ffn_grad, weight_grad = tokens * model.ffn_hidden_size / tp * c, h * model.ffn_hidden_size / tp * prec.grad
    vocab = tokens * model.vocab_size / tp  # elements of one micro-batch's logits
    final_norm = tokens * saved_bytes_per_token(fig.final_norm[c], tp, sp, "none", block_input) if shape.last else 0.0
    m, v = layout.grad_accum(model), stage_chunks(layout)

    peaks: dict[str, tuple[float, float, float]] = {}

    def keep(phase: str, grads: float, activations: float, logits: float) -> None:
        if phase not in peaks or grads + activations + logits > sum(peaks[phase]):
            peaks[phase] = (grads, activations, logits)

    extras = _pipeline_extras(model, layout, prec, shape) if layout.pp > 1 else lambda chunks, postponed: 0.0
    for chunks, postponed in points:
        accumulating = m * v > chunks
        grads = full_grads if accumulating else 0.0
        stored = chunks * per_chunk + extras(chunks, postponed)
        swiglu = incoming + (max(weight_grad + ffn_grad, 2 * ffn_grad) if accumulating else weight_grad + 2 * ffn_grad)
        layer_grads = grads or head_grads
        if not shape.last:
            keep("layer_backward", layer_grads, stored + recomputed + swiglu, 0.0)
        elif layout.pp == 1:
            keep("layer_backward", layer_grads, stored + recomputed + swiglu, 0.0)
            keep("loss_backward", grads, stored + final_norm, 12 * vocab)
        else:
            # V schedules run the last stage's backward right after its forward. Under a
            # split backward the others have had their input step, which frees the logits
            # and the log_softmax output and keeps the head's output gradient instead.
            schedule = SCHEDULES[layout.schedule]
            waiting = 0 if schedule.v_shape else max(1, chunks // v) - 1
            split = schedule.split_backward
            saved = waiting * (final_norm + vocab * (c if split else 4 + c))
            keep("layer_backward", layer_grads, stored + recomputed + swiglu + saved, vocab * c)
            keep("loss_backward", grads, stored + final_norm + saved, vocab * (4 + c + 8))
    return peaks
