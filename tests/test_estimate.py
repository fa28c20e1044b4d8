"""The estimator: known answers, the schedules' counts against torch's own, monotonic
sanity, calibration, the command line, and that it never imports torch."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from autotune.cli import main
from autotune.config import GIB, as_trained, load_hardware, load_model
from autotune.errors import UsageError
from autotune.estimate import (
    Calibration,
    budget_bytes,
    calibrate,
    default_calibration,
    estimate,
    every_layout,
    rank_estimates,
)
from autotune.estimate.memory import (
    Saved,
    SavedTotals,
    chunks_in_flight,
    peak_points,
    pipeline_shapes,
    rank_memory,
    rank_shape,
    saved_bytes_per_token,
)
from autotune.plan.layout import Layout, resolve
from autotune.plan.stage_split import rank_stage_ids

TINY = load_model("tiny")
LLAMA_70B = load_model("llama3-70b")
H100 = load_hardware("h100-sxm")
# Links so fast that communication vanishes, for the pure pipeline formulas.
INSTANT_LINKS = dataclasses.replace(H100, scale_up_gbps=1e12, scale_out_gbps=1e12)
NO_LATENCY = Calibration(latency_s=0.0)


def state_bytes(model, layout: Layout, device: str) -> float:
    """Parameters, fp32 masters, gradients and AdamW states after a step, on pipeline rank 0."""
    terms = rank_memory(model, layout, device, rank_shape(model, layout, 0))["optimizer_step"]
    return terms["params"] + terms["master_params"] + terms["grads"] + terms["optimizer"]


# -- known answers ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype, zero, dp_shard, expected", [
    ("fp32", 0, 8, 16.0),  # nothing sharded: 4 params + 4 grads + 8 AdamW
    ("bf16", 0, 8, 18.0),  # 2 bf16 params + 4 fp32 grads + 4 fp32 masters + 8 AdamW
    ("fp32", 1, 8, 4 + 4 + 8 / 8),  # AdamW states sliced over dp_shard
    ("bf16", 1, 8, 2 + 4 + 12 / 8),  # ... and the masters with them
    ("fp32", 2, 8, 16 / 8),  # FSDP: fp32 shards of parameters, gradients and states
    ("bf16", 2, 8, 16 / 8),  # (the shards are the masters; the bf16 copies come and go)
    ("bf16", 3, 8, 16 / 8),
    ("bf16", 3, 2, 16 / 2),  # HSDP: sharded over dp_shard only
])
def test_bytes_per_parameter_for_each_zero(device, dtype, zero, dp_shard, expected):
    model = dataclasses.replace(LLAMA_70B, dtype=dtype)
    layout = resolve(f"dp=8,dp_shard={dp_shard},zero={zero}", model, 8)
    assert state_bytes(model, layout, device) / model.num_params() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("zero, expected", [
    (0, 16 + 4),  # 2 params + 2 grads + 4 masters + 8 AdamW, and the step's fp32 gradient copy
    (1, 4 + 16 / 8),  # Megatron's table for bf16 gradients: the copy sliced with the masters
    (3, 16 / 8),  # FSDP: reduces in bf16 into its fp32 shards; nothing more stays
])
def test_bf16_gradients_hold_megatrons_bytes_per_parameter(zero, expected):
    model = dataclasses.replace(LLAMA_70B, dtype="bf16", grad_dtype="bf16")
    layout = resolve(f"dp=8,zero={zero}", model, 8)
    terms = rank_memory(model, layout, "cuda", rank_shape(model, layout, 0))["optimizer_step"]
    held = terms["params"] + terms["master_params"] + terms["grads"] + terms["optimizer"]
    copies = terms["temporaries"] if zero < 2 else 0.0
    if zero == 1:  # the all-gather of the updated parameters comes after the copies are freed
        assert copies == pytest.approx(4 * model.num_params() / 8)
    assert (held + copies) / model.num_params() == pytest.approx(expected, rel=1e-12)
    bf16, fp32 = (estimate(m, layout, H100) for m in (model, dataclasses.replace(model, grad_dtype="fp32")))
    assert bf16.peak_mem_bytes < fp32.peak_mem_bytes if zero < 2 else bf16.peak_mem_bytes <= fp32.peak_mem_bytes
    assert bf16.comm_s["dp"] < fp32.comm_s["dp"]  # half the bytes to reduce


def test_70b_dense_in_mixed_precision_with_adam_needs_18_bytes_per_parameter():
    one_gpu = resolve("", LLAMA_70B, 1)
    total = state_bytes(LLAMA_70B, one_gpu, "cuda")
    assert total / LLAMA_70B.num_params() == pytest.approx(18.0)
    assert 1.2e12 < total < 1.35e12  # ~1.27 TB of static state
    # The model computes on its bf16 parameters; nothing is gathered at zero 0.
    terms = rank_memory(LLAMA_70B, one_gpu, "cuda", rank_shape(LLAMA_70B, one_gpu, 0))["loss_backward"]
    assert terms["params"] == pytest.approx(2 * LLAMA_70B.num_params()) and terms["gathered_params"] == 0


def bubble(layout_text: str, gpus: int) -> tuple[float, int]:
    layout = resolve(layout_text, LLAMA_70B, gpus, 8)
    e = estimate(LLAMA_70B, layout, INSTANT_LINKS, calibration=NO_LATENCY)
    return e.bubble_fraction, e.grad_accum


@pytest.mark.parametrize("pp, mbs, schedule", [(4, 1, "1f1b"), (8, 2, "1f1b"), (4, 4, "gpipe")])
def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, mbs, schedule):
    fraction, m = bubble(f"tp=8,pp={pp},dp=8,mbs={mbs},schedule={schedule}", 64 * pp)
    assert fraction == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-6)


@pytest.mark.parametrize("pp, vpp", [(4, 2), (2, 4), (8, 2)])
def test_interleaved_bubble_is_p_minus_1_over_v_m_plus_p_minus_1(pp, vpp):
    fraction, m = bubble(f"tp=8,pp={pp},dp=8,schedule=interleaved_1f1b,vpp={vpp}", 64 * pp)
    assert fraction == pytest.approx((pp - 1) / (vpp * m + pp - 1), rel=1e-6)
    plain, _ = bubble(f"tp=8,pp={pp},dp=8,schedule=1f1b", 64 * pp)
    zero_bubble, _ = bubble(f"tp=8,pp={pp},dp=8,schedule=zero_bubble,vpp={vpp}", 64 * pp)
    assert zero_bubble < fraction < plain


def paper_gpt_block(a: int, h: int, s: int) -> list[Saved]:
    """Korthikanti et al. 2022, section 4.1: a GPT block in 16-bit with 1-byte dropout masks."""
    return [
        Saved("layernorm 1 input", h, 2, "sp"), Saved("qkv input", h, 2, "sp"),
        Saved("q, k", 2 * h, 2, "tp"), Saved("softmax output", a * s, 2, "tp", core=True),
        Saved("softmax dropout mask", a * s, 1, "tp", core=True),
        Saved("softmax dropout output", a * s, 2, "tp", core=True), Saved("v", h, 2, "tp"),
        Saved("projection input", h, 2, "tp"), Saved("attention dropout mask", h, 1, "sp"),
        Saved("layernorm 2 input", h, 2, "sp"), Saved("mlp input", h, 2, "sp"),
        Saved("gelu input", 4 * h, 2, "tp"), Saved("gelu output", 4 * h, 2, "tp"),
        Saved("mlp dropout mask", h, 1, "sp"),
    ]


@pytest.mark.parametrize("a, h, s, b, t", [(64, 8192, 2048, 1, 8), (96, 12288, 2048, 2, 4), (32, 4096, 4096, 4, 2)])
def test_layer_activations_match_the_paper(a, h, s, b, t):
    saved = SavedTotals.of(paper_gpt_block(a, h, s))

    def layer(tp, sp, recompute):
        return s * b * saved_bytes_per_token(saved, tp, sp, recompute, block_input=2 * h)

    sbh = s * b * h
    assert layer(1, False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert layer(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer(t, True, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert layer(t, True, "selective") == pytest.approx(sbh / t * 34)
    assert layer(t, True, "full") == pytest.approx(2 * sbh / t)


# -- the schedules hold what torch's schedules hold ------------------------------------------------

TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                   "zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def torch_in_flight(schedule: str, pp: int, m: int, vpp: int) -> list[int]:
    """Most forwards held per rank in torch's action lists: a forward adds one, the
    backward that frees its activations (for split backwards, the weight step) one less."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(TORCH_SCHEDULES[schedule], pp, m, vpp if vpp > 1 else None)
    split = schedule in ("zero_bubble", "zbv", "dualpipev")
    peaks = []
    for rank_ops in ops:
        held = peak = 0
        for action in filter(None, rank_ops):
            for a in action.sub_actions or (action,):
                kind = a.computation_type.value
                if kind == "F":
                    held += 1
                    peak = max(peak, held)
                elif kind == "B" or (kind == "W" and split) or (kind == "I" and not split):
                    held -= 1
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule, vpp, pp, m", [
    (s, v, p, m) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
                              ("zero_bubble", 2), ("zero_bubble", 4), ("zbv", 2), ("dualpipev", 2))
    for p in (2, 4) for m in (1, 2, 4, 6, 8, 16)
    if not (s == "1f1b" and m < p) and not (s == "dualpipev" and m < 2 * p)
    and not (s in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // p))
])
def test_microbatches_in_flight_match_torch_schedules(schedule, vpp, pp, m):
    layout = Layout(pp=pp, vpp=vpp, schedule=schedule)
    ours = [chunks_in_flight(layout, m, rank) for rank in range(pp)]
    assert ours == torch_in_flight(schedule, pp, m, vpp)


def torch_rank_timelines(schedule: str, pp: int, m: int, vpp: int) -> list[list[tuple[int, int]]]:
    """Per rank, after each action of torch's list: (forwards held, postponed weight steps
    of stages but the first). A split backward's input step (I) postpones, its weight
    step (W) frees; stage 0's input step computes nothing (torch runs its whole backward
    at W)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    timelines = []
    for rank_ops in get_schedule_ops(TORCH_SCHEDULES[schedule], pp, m, vpp):
        held = postponed = 0
        timeline = []
        for action in filter(None, rank_ops):
            for a in action.sub_actions or (action,):
                kind = a.computation_type.value
                held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
                if a.stage_index > 0:
                    postponed += {"I": 1, "W": -1}.get(kind, 0)
                timeline.append((held, postponed))
        timelines.append(timeline)
    return timelines


@pytest.mark.parametrize("schedule, vpp, pp, m", [
    (s, v, p, m) for s, v in (("zero_bubble", 2), ("zero_bubble", 4), ("zbv", 2), ("dualpipev", 2))
    for p in (2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12, 16)
    if not (s == "dualpipev" and m < 2 * p) and not (s == "zero_bubble" and m % max(1, m // p))
    and not (s == "zbv" and p < m < 2 * p - 1)  # peak_points leaves out two light moments there
])
def test_split_backward_peaks_match_torch_schedules(schedule, vpp, pp, m):
    """For activations per chunk A and postponed output gradients P with P <= A (about
    0.7 A in a Llama block), the heaviest moment of torch's action list, max(A * held +
    P * postponed), is one of peak_points."""
    layout = Layout(pp=pp, vpp=vpp, schedule=schedule)
    for rank, timeline in enumerate(torch_rank_timelines(schedule, pp, m, vpp)):
        for a, p in ((1.0, 0.0), (1.0, 0.5), (1.0, 1.0)):
            ours = max(a * held + p * postponed for held, postponed in peak_points(layout, m, rank))
            assert ours == max(a * held + p * postponed for held, postponed in timeline), (rank, a, p)


@pytest.mark.parametrize("schedule, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                           ("interleaved_1f1b", 3), ("zero_bubble", 2), ("zbv", 2),
                                           ("dualpipev", 2)])
def test_a_ranks_sends_per_step_match_torch_schedules(schedule, vpp):
    """Activations sent forward by stages whose next stage is on another rank, gradients
    sent back by stages fed from another rank: m * (sending_across + receiving_across)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    pp, m = 4, 8
    model = dataclasses.replace(TINY, num_layers=24)
    layout = Layout(pp=pp, vpp=vpp, schedule=schedule)
    owner = {s: r for r in range(pp) for s in rank_stage_ids(layout, r)}
    last = pp * vpp - 1
    for rank, rank_ops in enumerate(get_schedule_ops(TORCH_SCHEDULES[schedule], pp, m, vpp if vpp > 1 else None)):
        sends = 0
        for action in filter(None, rank_ops):
            for a in action.sub_actions or (action,):
                stage, kind = a.stage_index, a.computation_type.value
                sends += kind == "F" and stage < last and owner[stage + 1] != rank
                sends += kind in ("B", "I") and stage > 0 and owner[stage - 1] != rank
        shape = rank_shape(model, layout, rank)
        assert sends == m * (shape.sending_across + shape.receiving_across), rank


# -- monotonic sanity -------------------------------------------------------------------------------

def peak(text: str, gpus: int, model=LLAMA_70B, device="cuda") -> float:
    return estimate(model, resolve(text, model, gpus, 8), H100, device=device).peak_mem_bytes


def activations(text: str, gpus: int, model=LLAMA_70B) -> float:
    return estimate(model, resolve(text, model, gpus, 8), H100).memory["activations"]


def test_more_tensor_parallel_holds_less_per_rank():
    for extra in ("zero=0", "zero=3"):
        peaks = [peak(f"tp={tp},{extra}", 8) for tp in (1, 2, 4, 8)]
        assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
    with_sp = [peak(f"tp={tp},sp={int(tp > 1)},pp=8,zero=1", 64) for tp in (1, 2, 4, 8)]
    assert with_sp == sorted(with_sp, reverse=True) and len(set(with_sp)) == 4, with_sp


def test_recompute_keeps_fewer_activations():
    kept = [activations(f"tp=8,pp=8,recompute={r}", 64) for r in ("none", "selective", "full")]
    assert kept[0] > kept[1] > kept[2]
    assert kept[2] < 0.2 * kept[0]


def test_op_recompute_keeps_every_other_matmul_output_as_torchtitan():
    """torchtitan's op policy on a Llama block: wq, wv, up and down outputs kept (with the
    block input, the attention output and its log-sum-exp); wk, wo and gate recomputed,
    which costs their forward matmuls again: more time than none, less than full."""
    from autotune.estimate.memory import layer_bytes

    m = LLAMA_70B
    q, kv, h, ffn = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.hidden_size, m.ffn_hidden_size
    expected = 2 * (h + q + kv + q + ffn + h) + 4 * m.num_heads
    assert layer_bytes(m, False, 2, False, 1, False, "op") == expected
    texts = [f"tp=8,recompute={r}" for r in ("none", "op", "full")]
    none, op, full = (estimate(m, resolve(t, m, 8, 8), H100, calibration=NO_LATENCY) for t in texts)
    assert none.step_time_s < op.step_time_s < full.step_time_s
    rerun = 2 * m.seq_len * (h * kv + q * h + h * ffn) / 8 * m.num_layers * op.grad_accum
    flops_per_s = H100.peak_tflops * 1e12 * NO_LATENCY.compute_efficiency
    assert op.compute_s - none.compute_s == pytest.approx(rerun / flops_per_s, rel=1e-6)


def test_recompute_layers_keep_some_layers_whole_and_cost_less_time():
    """Full recompute of the first K layers of each stage holds between none and full,
    in the order the layouts are priced (one model's memo serves them all)."""
    texts = [f"tp=8,pp=8,recompute={r}" for r in ("none", "full")] + ["tp=8,pp=8,recompute=full,recompute_layers=4"]
    none, full, partial = (activations(t, 64) for t in texts)
    assert full < partial < none
    again = [activations(t, 64) for t in reversed(texts)]
    assert again == [partial, full, none]
    times = [estimate(LLAMA_70B, resolve(t, LLAMA_70B, 64, 8), H100).step_time_s for t in texts]
    assert times[0] < times[2] < times[1]


def test_larger_micro_batches_hold_more_activations():
    kept = [activations(f"tp=8,pp=8,mbs={mbs}", 64) for mbs in (1, 2, 4)]
    assert kept[0] < kept[1] < kept[2]


def test_sequence_and_context_parallel_cut_activations():
    assert activations("tp=8,sp=1,pp=8", 64) < activations("tp=8,pp=8", 64)
    assert activations("tp=8,pp=8,cp=2", 128) < activations("tp=8,pp=8", 64)


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp():
    assert activations("tp=8,pp=8,schedule=gpipe", 64) > 3 * activations("tp=8,pp=8,schedule=1f1b", 64)


def test_expert_parallel_splits_the_experts():
    mixtral = load_model("mixtral-8x7b")
    shapes = [rank_shape(mixtral, resolve(f"ep={ep},dp=8", mixtral, 8), 0) for ep in (1, 2, 8)]
    assert [s.expert_params for s in shapes] == pytest.approx([shapes[0].expert_params / ep for ep in (1, 2, 8)])
    peaks = [peak(f"ep={ep},dp=8,zero=1", 8, mixtral) for ep in (1, 2, 8)]
    assert peaks[0] > peaks[1] > peaks[2]


def test_expert_weights_per_ep_rank_and_moe_blocks_whole_under_tp():
    """Each ep rank holds num_experts/ep experts of every layer, 3 * hidden * ffn each;
    tensor parallel cuts attention but leaves the router and the experts whole."""
    mixtral = load_model("mixtral-8x7b")
    expert = 3 * 4096 * 14336
    for ep, tp in ((1, 1), (2, 1), (8, 1), (2, 2), (4, 2)):
        shape = rank_shape(mixtral, resolve(f"ep={ep},tp={tp}", mixtral, 16, 8), 0)
        assert shape.expert_params == 32 * 8 // ep * expert
        attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
        block = attention / tp + 2 * 4096 + 4096 * 8  # attention split, norms and router whole
        assert shape.dense_params == pytest.approx(32 * block + 2 * 32000 * 4096 / tp + 4096)


def test_moe_activations_are_per_routed_row_and_not_split_by_tp():
    """Doubling top_k doubles the dispatched rows (tokens, their SwiGLU tensors, the
    outputs, indices and weights); tensor parallel does not divide them."""
    moe = load_model("tiny-moe")
    wider = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, top_k=4))

    def moe_bytes(model, tp: int) -> float:
        layout = resolve(f"tp={tp},mbs=16", model, tp)
        return estimate(model, layout, load_hardware("cpu"), device="cpu").memory["activations"]

    h, ef, c, tokens, layers = 64, 64, 4, 16 * 64, 8
    # dispatched and output rows, SwiGLU, routing weight, choice + permutation + inverse (int64), fp32 probability
    per_row = 2 * h * c + 3 * ef * c + c + 3 * 8 + 4
    assert moe_bytes(wider, 1) - moe_bytes(moe, 1) == pytest.approx(layers * tokens * 2 * per_row, rel=1e-9)
    attention_split = moe_bytes(moe, 1) - moe_bytes(moe, 2)
    assert 0 < attention_split < 0.25 * moe_bytes(moe, 1)  # only the attention's heads are divided


def test_all_to_all_volume_of_expert_parallel():
    """Per MoE layer and micro-batch: a counts exchange and a dispatch and a combine of
    tokens * k rows of hidden bf16 forward, the two token exchanges again backward; each
    sends (ep-1)/ep of its bytes over NVLink inside a node. Sequence parallel does not
    shrink them: MoE blocks see whole sequences."""
    mixtral = load_model("mixtral-8x7b")
    links = H100.scale_up_gbps * 1e9 * NO_LATENCY.bandwidth_efficiency
    for text, gpus in (("ep=8,mbs=1", 8), ("ep=4,tp=2,sp=1,mbs=1", 8)):
        layout = resolve(text, mixtral, gpus, 8)
        e = estimate(mixtral, layout, H100, calibration=NO_LATENCY)
        ep = layout.ep
        rows_bytes = 4096 * 2 * 4096 * 2  # seq * top_k * hidden * bf16
        one = rows_bytes * (ep - 1) / ep / links
        counts = 8 * 8 * (ep - 1) / ep / links
        assert e.comm_s["ep"] == pytest.approx(layout.grad_accum(mixtral) * 32 * (4 * one + counts), rel=1e-9)


# -- time -------------------------------------------------------------------------------------------

def test_time_figures_agree_with_each_other():
    layout = resolve("tp=8,pp=4,zero=1,sp=1", LLAMA_70B, 1024, 8)
    e = estimate(LLAMA_70B, layout, H100, 80 * GIB)
    assert e.tokens_per_s == pytest.approx(LLAMA_70B.global_batch_size * LLAMA_70B.seq_len / e.step_time_s)
    assert e.mfu == pytest.approx(LLAMA_70B.flops_per_token() * e.tokens_per_s / (1024 * H100.peak_tflops * 1e12))
    assert 0 < e.bubble_fraction < 1 and 0 < e.comm_fraction <= e.total_comm_fraction
    assert e.mfu < default_calibration("cuda").compute_efficiency  # bubble and communication cost something
    assert set(e.comm_s) == {"tp", "dp", "pp"}
    assert sum(e.memory.values()) == pytest.approx(e.peak_mem_bytes)


def test_a_group_across_nodes_gets_its_members_nics():
    """TP 8 on nodes of 4 GPUs: the ring crosses nodes with 4 members (4 NICs) per node,
    so TP communication slows by NVLink / (4 x NIC) bandwidth."""
    layout = resolve("tp=8,dp=8", LLAMA_70B, 64)
    small_nodes = H100.with_gpus_per_host(4)
    inside = estimate(LLAMA_70B, layout, H100, calibration=NO_LATENCY)
    across = estimate(LLAMA_70B, layout, small_nodes, calibration=NO_LATENCY)
    ratio = H100.scale_up_gbps / (4 * H100.scale_out_gbps)
    assert across.comm_s["tp"] / inside.comm_s["tp"] == pytest.approx(ratio)
    assert across.step_time_s > inside.step_time_s


def test_context_parallel_ring_volume_and_what_it_hides():
    """Per layer and micro-batch the ring sends the local KV block on cp-1 times forward,
    cp-1 times backward, and the fp32 dK/dV accumulator cp times; full recompute runs
    the forward ring again, selective keeps its output. Over 32 ranks with tp=8 inside
    a node the cp group crosses nodes (each hop on one NIC). At 32k tokens attention's
    compute hides every hop but the last dK/dV one per layer; at 8k it hides less."""
    long = dataclasses.replace(LLAMA_70B, seq_len=32768, global_batch_size=128)
    kv_bytes = long.seq_len / 4 * 2 * long.num_kv_heads * long.head_dim / 8 * 2  # seq/cp tokens, kv/tp heads, bf16
    hop_s = kv_bytes / (H100.scale_out_gbps * 1e9 * NO_LATENCY.bandwidth_efficiency)
    layers_x_microbatches = long.num_layers * long.global_batch_size

    def ring(model, recompute):
        e = estimate(model, resolve(f"tp=8,cp=4,zero=1,recompute={recompute}", model, 32, 8), H100,
                     calibration=NO_LATENCY)
        return e.comm_s["cp"], e.exposed_comm_s["cp"]

    none, selective, full = (ring(long, r) for r in ("none", "selective", "full"))
    assert none[0] == pytest.approx(layers_x_microbatches * (3 + 3 + 4 * 2) * hop_s)  # dK/dV: twice the bytes
    assert selective == none
    assert full[0] == pytest.approx(layers_x_microbatches * (3 + 3 + 3 + 4 * 2) * hop_s)
    assert none[1] == pytest.approx(layers_x_microbatches * 2 * hop_s)  # the last dK/dV hop home
    total, exposed = ring(LLAMA_70B, "none")
    assert 2 / 14 < exposed / total < 1


def test_without_a_peak_only_memory_is_estimated():
    cpu = load_hardware("cpu")
    e = estimate(TINY, resolve("dp=2", TINY, 2), cpu, device="cpu")
    assert e.peak_mem_bytes > 0 and e.fits and math.isnan(e.step_time_s)
    d = e.to_dict()
    assert d["step_time_s"] is None and d["layout"] == str(e.layout)
    json.dumps(d, allow_nan=False)


def test_budget():
    layout = resolve("", TINY, 1)
    e = estimate(TINY, layout, H100, memory_budget_bytes=1e6, device="cpu")
    assert not e.fits and estimate(TINY, layout, H100, device="cpu").fits
    assert budget_bytes(H100, None) == 80 * GIB and budget_bytes(H100, 2.0) == 2 * GIB
    assert budget_bytes(load_hardware("cpu"), None) is None


# -- calibration --------------------------------------------------------------------------------------

def test_calibration_recovers_known_distortions():
    """Trials made from the estimate itself with compute twice as slow, links at half
    speed and memory 10% larger plus 1 MB: calibrate finds exactly those factors."""
    prior = default_calibration("cuda")
    truth = dataclasses.replace(prior, compute_efficiency=prior.compute_efficiency / 2,
                                bandwidth_efficiency=prior.bandwidth_efficiency / 2)
    measured = []
    for text in ("tp=8,pp=4,zero=1", "tp=4,pp=8,zero=2,mbs=2", "tp=8,pp=2,cp=2,zero=3,recompute=full",
                 "tp=2,pp=8,sp=1,zero=1,schedule=interleaved_1f1b,vpp=2"):
        layout = resolve(text, LLAMA_70B, 512, 8)
        real = estimate(LLAMA_70B, layout, H100, calibration=truth)
        before = estimate(LLAMA_70B, layout, H100)
        measured.append((layout, {"status": "complete", "step_time_s": real.step_time_s,
                                  "comm_fraction": real.total_comm_fraction,
                                  "exposed_comm_fraction": real.comm_fraction,
                                  "peak_mem_bytes": 1.1 * before.peak_mem_bytes + 1e6}))
    measured.append((layout, {"status": "failed", "reason": "crash"}))
    fitted = calibrate(measured, LLAMA_70B, H100)
    assert fitted.trials_used == 4
    assert fitted.memory_scale == pytest.approx(1.1) and fitted.memory_offset_bytes == pytest.approx(1e6, rel=1e-3)
    assert fitted.compute_efficiency == pytest.approx(truth.compute_efficiency, rel=0.1)
    assert fitted.bandwidth_efficiency == pytest.approx(truth.bandwidth_efficiency, rel=0.1)
    for layout, trial in measured[:-1]:
        again = estimate(LLAMA_70B, layout, H100, calibration=fitted)
        assert again.peak_mem_bytes == pytest.approx(trial["peak_mem_bytes"], rel=1e-6)
        assert again.step_time_s == pytest.approx(trial["step_time_s"], rel=0.1)


def test_calibration_without_usable_trials_keeps_the_prior():
    layout = resolve("", TINY, 1)
    assert calibrate([], TINY, H100) == default_calibration("cuda")
    assert calibrate([(layout, {"status": "pruned", "reason": "oom"})], TINY, H100, "cpu") \
        == dataclasses.replace(default_calibration("cpu"), trials_used=0)


# -- every layout ------------------------------------------------------------------------------------

def test_every_layout_ranked_fitting_first_then_by_tokens_per_second():
    llama_8b = load_model("llama3-8b")
    layouts = every_layout(llama_8b, 16, 8)
    assert {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"} <= {l.schedule for l in layouts}
    assert {l.zero for l in layouts} == {0, 1, 2, 3}
    assert {l.recompute for l in layouts} == {"none", "selective", "op", "full"}
    assert {l.recompute_layers for l in layouts} == {0, 2, 4}
    assert max(l.tp for l in layouts) == 8 and max(l.cp for l in layouts) > 1 and any(l.sp for l in layouts)
    assert any(l.dp_shard < l.dp for l in layouts)
    ranked = rank_estimates([estimate(llama_8b, l, H100, 80 * GIB) for l in layouts])
    fits = [e.fits for e in ranked]
    assert any(fits) and not all(fits) and fits == sorted(fits, reverse=True)
    fitting = [e.tokens_per_s for e in ranked if e.fits]
    assert fitting == sorted(fitting, reverse=True)


# -- the command line ---------------------------------------------------------------------------------

def test_cli_bf16_gradients_lower_the_peak(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--layout", "dp=8,zero=1", "--json"]
    peaks = []
    for grads in ("fp32", "bf16"):
        assert main([*argv, "--grad-dtype", grads]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["memory"]["grads"])
    assert peaks[1] == pytest.approx(peaks[0] / 2)


def test_cli_one_layout_json(capsys):
    assert main(["estimate", "--model", "llama3-70b", "--gpus", "64", "--layout", "tp=8,pp=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"].startswith("tp=8,pp=8,") and out["device"] == "cuda"
    assert out["memory_budget_bytes"] == 80 * GIB
    assert sum(out["memory"].values()) == pytest.approx(out["peak_mem_bytes"])
    assert out["tokens_per_s"] > 0


def test_cli_every_layout_json_and_table(capsys):
    assert main(["estimate", "--model", "tiny", "--gpus", "4", "--json", "--memory-budget-gb", "0.001",
                 "--hardware", "cpu", "--peak-tflops", "0.1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["memory_budget_bytes"] == pytest.approx(0.001 * GIB)
    rows = out["layouts"]
    assert len({r["layout"] for r in rows}) == len(rows)
    assert len(rows) + out["state_over_budget"] == out["valid_layouts"] == len(every_layout(TINY, 4, 1024))
    assert [r["fits"] for r in rows] == sorted((r["fits"] for r in rows), reverse=True)
    assert main(["estimate", "--model", "tiny", "--gpus", "4", "--top", "3"]) == 0
    table = capsys.readouterr().out
    assert "valid layouts of tiny on 4 x h100-sxm" in table and "predicted OOM" in table


@pytest.mark.parametrize("argv, message", [
    (["--layout", "tp=3"], "tp*pp*cp = 3*1*1 = 3 must divide --gpus 4"),
    (["--layout", "sp=1"], "layout.sp: sequence parallel needs tp > 1"),
    (["--hardware", "nope"], "hardware: unknown preset 'nope'"),
    (["--hardware", "cpu", "--grad-dtype", "bf16"], "--grad-dtype: with dtype fp32 must be fp32, got 'bf16'"),
    (["--dtype", "fp16", "--grad-dtype", "bf16"], "--grad-dtype: with dtype fp16 must be fp16 or fp32"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(["estimate", "--model", "tiny", "--gpus", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_estimate_modules_do_not_import_torch():
    code = ("import sys\n"
            "from autotune.cli import main\n"
            "from autotune.estimate import estimate, every_layout\n"
            "main(['estimate', '--model', 'tiny', '--gpus', '2', '--json'])\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout)


def test_output_into_a_closed_pipe_exits_quietly():
    """`autotune estimate ... | head`: the reader leaves early; no traceback, exit 1 (as
    rich's console exits), for the JSON document and the table alike."""
    for fmt in (["--json"], []):
        proc = subprocess.Popen([sys.executable, "-m", "autotune", "estimate", "--model", "tiny", "--gpus", "8",
                                 "--top", "400", *fmt], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.read(100)
        proc.stdout.close()  # the reader leaves long before the output ends
        assert proc.wait(timeout=120) == 1
        assert proc.stderr.read() == b""


# -- precisions ---------------------------------------------------------------------------------------

def test_fp8_prices_the_linears_at_the_fp8_peak_and_reports_mfu_against_bf16():
    """fp8 on an H100: the blocks' linears at the fp8 peak (twice bf16's) times the 8-bit
    efficiency, the attention core and the head at bf16's; memory as bf16 but for the 8-bit
    casts a backward GEMM holds; MFU over the bf16 peak, so it rises with the speed."""
    model = load_model("llama3-8b")
    layout = resolve("dp=8,zero=1,recompute=selective", model, 8, 8)
    bf16 = estimate(model, layout, H100, device="cuda", dtype="bf16", calibration=NO_LATENCY)
    fp8 = estimate(model, layout, H100, device="cuda", dtype="fp8", calibration=NO_LATENCY)
    fp16 = estimate(model, layout, H100, device="cuda", dtype="fp16", calibration=NO_LATENCY)
    assert fp16.step_time_s == bf16.step_time_s and fp16.peak_mem_bytes == bf16.peak_mem_bytes
    assert 1.05 < bf16.step_time_s / fp8.step_time_s < 1.3  # the range published fp8 speedups fall in
    assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step_time_s / fp8.step_time_s)
    assert fp8.peak_mem_bytes >= bf16.peak_mem_bytes
    # With the 8-bit GEMMs as efficient as bf16's, the linears take exactly half the time.
    even = dataclasses.replace(NO_LATENCY, linear_8bit_efficiency=1.0)
    flat = estimate(model, layout, H100, device="cuda", dtype="fp8", calibration=even)
    assert flat.step_time_s < fp8.step_time_s


def test_fp8_casts_are_held_by_the_layer_backward():
    model = load_model("llama3-8b")
    layout = resolve("dp=8,pp=2,zero=1", model, 16, 8)
    shape = pipeline_shapes(model, layout)[0]  # the first stage: no head, its peak is a layer's backward
    trained = {d: as_trained(model, "cuda", d) for d in ("bf16", "fp8", "mxfp8")}
    held = {d: rank_memory(m, layout, "cuda", shape)["layer_backward"]["temporaries"] for d, m in trained.items()}
    tokens, h, ffn = layout.mbs * model.seq_len, model.hidden_size, model.ffn_hidden_size
    casts = tokens * h + tokens * ffn + h * ffn
    assert held["fp8"] - held["bf16"] == pytest.approx(casts)
    assert held["mxfp8"] - held["bf16"] == pytest.approx(casts * (1 + 1 / 32))


def test_a_device_without_the_precision_refuses():
    layout = resolve("dp=8", TINY, 8, 8)
    with pytest.raises(UsageError, match=r"^dtype: a100-80gb has no fp8"):
        estimate(TINY, layout, load_hardware("a100-80gb"), device="cuda", dtype="fp8")
    with pytest.raises(UsageError, match=r"^dtype: h100-sxm has no mxfp8"):
        estimate(TINY, layout, H100, device="cuda", dtype="mxfp8")
    # The CPU preset has no table: it prices memory, and time once --peak-tflops is given.
    assert estimate(TINY, layout, load_hardware("cpu"), device="cpu", dtype="fp8").peak_mem_bytes > 0


def test_state_floor_is_below_every_peak_and_skips_only_layouts_that_do_not_fit():
    """price_every_layout leaves unpriced only layouts whose state alone is over the
    budget, and counts them; the floor is a true lower bound of the estimated peak on
    every layout, and reads only the state keys (the enumeration asks it with the other
    keys at their defaults)."""
    from autotune.estimate import memory as estimate_memory
    from autotune.estimate import price_every_layout
    from autotune.estimate.memory import state_floor
    from autotune.estimate.pricing import trained_model
    from autotune.plan.layout import STATE_KEYS
    moe = load_model("tiny-moe")
    assert H100.scale_up_gpus == 8
    layouts = every_layout(moe, 8, 8)
    estimates = [estimate(moe, layout, H100) for layout in layouts]
    trained = trained_model(moe, "cuda", None, None)
    floors = [state_floor(trained, layout, "cuda") for layout in layouts]
    assert all(f <= e.peak_mem_bytes for f, e in zip(floors, estimates))
    state_only = [Layout(dp=layout.dp, **{k: getattr(layout, k) for k in STATE_KEYS}) for layout in layouts]
    estimate_memory.model_figures.cache_clear()
    assert [state_floor(trained_model(moe, "cuda", None, None), layout, "cuda") for layout in state_only] == floors
    budget = sorted(floors)[len(floors) // 2]  # half the layouts' state is over it
    priced, valid, skipped = price_every_layout(moe, 8, H100, budget)
    assert valid == len(layouts)
    assert skipped == sum(f > budget for f in floors) > 0
    assert [e.layout for e in priced] == [l for l, f in zip(layouts, floors) if f <= budget]
    assert price_every_layout(moe, 8, H100, None)[1:] == (len(layouts), 0)
