"""Step time of a layout: compute from FLOPs, communication from volumes and links,
the pipeline bubble per schedule.

    step = m * (F + B + W) of the slowest pipeline rank + bubble + exposed DP and PP communication

F, B and W are one micro-batch's forward, input-gradient and weight-gradient work on
that rank, TP, EP and CP communication on the critical path included. Overlap
assumptions: TP and EP collectives are never hidden; CP's KV ring hides behind the
attention core it feeds (but for the last dK/dV hop home); the DP gradient reduction
(once per step, on the last micro-batch) hides behind that micro-batch's backward but
for the last layer's share; FSDP's all-gathers hide behind the compute they prefetch
for; ZeRO-1's all-gather of updated parameters follows the optimizer step; pipeline
transfers cost one hop per micro-batch and stage each way. The optimizer step
(memory-bound) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from autotune.config import HardwareConfig, ModelConfig, model_size
from autotune.estimate import mamba
from autotune.estimate.memory import (
    RankShape,
    attention_widths,
    full_recompute_layers,
    model_figures,
    op_recomputed_params,
    precision,
    reshards_after_forward,
    stage_chunks,
)
from autotune.plan.layout import Layout
from autotune.plan.mesh_layout import Group, ParallelDims, mesh_groups
from autotune.plan.schedules import SCHEDULES

# -- links ------------------------------------------------------------------------------------

class Links(NamedTuple):
    """Transfer times on `hardware`, scaled by the achieved fraction of link bandwidth
    plus a fixed latency per operation."""

    hardware: HardwareConfig
    bandwidth_efficiency: float
    latency_s: float

    def ring_bandwidth(self, group: Group) -> float:
        """Bytes/s a ring collective moves per rank. Inside the scale-up domain (an HGX
        node's 8 GPUs, an NVL72 rack's 72): NVLink or Infinity Fabric. Across domains every
        member drives its own NIC and NCCL runs a ring per NIC, so k members per domain get
        k NICs' worth (never more than the scale-up link)."""
        hw = self.hardware
        gbps = hw.scale_up_gbps if group.inside_node(hw.scale_up_gpus) else \
            min(hw.scale_up_gbps, hw.scale_out_gbps * group.members_per_node(hw.scale_up_gpus))
        return gbps * 1e9 * self.bandwidth_efficiency

    def all_reduce(self, nbytes: float, group: Group) -> float:
        """Ring all-reduce: 2(n-1)/n of the buffer crosses each rank's link."""
        n = group.size
        return 0.0 if n == 1 or not nbytes else \
            2 * (n - 1) / n * nbytes / self.ring_bandwidth(group) + self.latency_s

    def gather_or_scatter(self, nbytes: float, group: Group) -> float:
        """All-gather or reduce-scatter; `nbytes` is the full (unsharded) size."""
        n = group.size
        return 0.0 if n == 1 or not nbytes else (n - 1) / n * nbytes / self.ring_bandwidth(group) + self.latency_s

    def all_to_all(self, nbytes: float, group: Group) -> float:
        """`nbytes` per rank spread evenly over the group: the share for peers in this
        scale-up domain goes over NVLink, the rest over this GPU's own NIC, both at once."""
        n = group.size
        if n == 1 or not nbytes:
            return 0.0
        hw = self.hardware
        local = group.members_per_node(hw.scale_up_gpus)
        eff = self.bandwidth_efficiency
        return max(nbytes * (local - 1) / n / (hw.scale_up_gbps * 1e9 * eff),
                   nbytes * (n - local) / n / (hw.scale_out_gbps * 1e9 * eff)) + self.latency_s

    def p2p(self, nbytes: float, group: Group) -> float:
        """One transfer between neighbours of the group."""
        if group.size == 1 or not nbytes:
            return 0.0
        hw = self.hardware
        gbps = hw.scale_up_gbps if group.inside_node(hw.scale_up_gpus) else hw.scale_out_gbps
        return nbytes / (gbps * 1e9 * self.bandwidth_efficiency) + self.latency_s


# -- pipeline bubble --------------------------------------------------------------------------

def bubble_time(layout: Layout, forward: float, backward_input: float, backward_weight: float) -> float:
    """Idle time of a pipeline rank per step, from one chunk's (a stage divided by vpp)
    forward F, input-gradient B (recompute included) and weight-gradient W times: pp - 1
    times the schedule's bubble per hop (autotune/plan/schedules.py), so (p-1)/(v*m+p-1) of
    the step without split backwards. Zero-bubble schedules reach zero only when B = W;
    the attention core's backward and recompute make B the larger.
    """
    if layout.pp == 1:
        return 0.0
    per_hop = SCHEDULES[layout.schedule].bubble(forward, backward_input, backward_weight)
    return (layout.pp - 1) * max(per_hop, 0.0)


# -- one micro-batch ---------------------------------------------------------------------------

@dataclass
class MicrobatchWork:
    """Seconds a pipeline rank spends on one micro-batch: forward, input-gradient and
    weight-gradient work with the communication on their critical path, and per
    dimension that communication (`critical`) and all of it (`total`)."""

    forward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0
    critical: dict[str, float] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)

    def add(self, times: tuple[float, float, float], count: float = 1) -> None:
        self.forward += count * times[0]
        self.backward_input += count * times[1]
        self.backward_weight += count * times[2]

    def add_comm(self, dim: str, forward: float, backward: float, total: float | None = None) -> None:
        self.forward += forward
        self.backward_input += backward
        self.critical[dim] = self.critical.get(dim, 0.0) + forward + backward
        self.total[dim] = self.total.get(dim, 0.0) + (forward + backward if total is None else total)

    @property
    def busy(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


def microbatch_works(model: ModelConfig, layout: Layout, links: Links, flops_per_s: float, compute_bytes: int,
                     shapes: list[RankShape], groups: dict[str, Group],
                     linear_flops_per_s: float | None = None) -> list[MicrobatchWork]:
    """One micro-batch's work on each pipeline rank in `shapes`.

    FLOPs as in ModelConfig.flops_per_token (2 per multiply-add; attention scores and
    values over the full sequence, no causal discount), split forward : input-gradient
    : weight-gradient = 1 : 1 : 1 for matmuls and 1 : 2 : 0 for the attention core.
    Recompute adds the forward of what it dropped (full: the block; selective: the
    core; op: every second matmul, op_rerun). A rank does 1/tp of the matmuls of its
    cp-th of the tokens, but all of an MoE block's (tensor parallel leaves MoE blocks
    whole: every tp rank routes the whole sequence); under expert parallel a rank's
    experts get, with even routing, as many rows (k per token) as its own tokens send
    out.

    `linear_flops_per_s`: the rate of the blocks' linear layers (attention projections,
    dense MLPs), which fp8 and mxfp8 run in 8 bits (the device's fp8 / MX peak); the
    attention core, MoE experts and router, and the head stay at `flops_per_s` (the
    runtime converts only those linears: runtime/precision.py).

    A hybrid model's blocks each have one mixer (estimate/mamba.py): one TP half a block, the
    Mamba scan's FLOPs beside the attention core's, the scan run again in its backward.

    Per layer: TP (+SP) two all-reduces, or two all-gathers and two reduce-scatters,
    each way (and the forward's again under full recompute); EP, per MoE layer, an
    all-to-all of the expert counts, then a dispatch and a combine all-to-all of tokens*k
    rows of hidden each way (the forward's again under full recompute; selective keeps
    the token all-to-alls and redoes the counts); CP's ring (see below).
    """
    fig = model_figures(model)
    tp, cp, c, h = layout.tp, layout.cp, compute_bytes, model.hidden_size
    tokens = layout.mbs * model.seq_len / cp
    act_bytes = tokens * h * c
    # One layer's attention core, forward: a third of its FLOPs per token (model_size:
    # 6 heads (qk + v) keys, averaged over the layers, windows and MLA's head dims included).
    core = tokens * model_figures(model).attention_flops_per_token / 3 / model.num_layers / tp / flops_per_s
    linear_rate = linear_flops_per_s or flops_per_s

    def op_rerun(moe: bool) -> float:
        """Op recompute's second matmuls (memory.op_recomputed_params): the
        attention's wk and wo split by tp; the MLP's gate or down split by tp, or the
        shared experts' whole (MoE blocks are not split) at the experts' rate."""
        q, k, _ = attention_widths(model)
        attention = (h * k + q * h) / tp / linear_rate
        mlp = op_recomputed_params(model, moe) - h * k - q * h
        return 2 * tokens * (attention + (mlp / flops_per_s if moe else mlp / tp / linear_rate))

    # Tensor parallel splits the attention's matmuls but MLA's down projections, which every
    # tp rank computes whole (runtime/mla.py; the latent norms counted with them are a rounding).
    whole = model_size.unsplit_attention_params(model)
    attention_params = (fig.attention - whole) / tp + whole

    def layer(mlp_params: float, mode: str, moe: bool = False) -> tuple[float, float, float]:
        mlp_rate = flops_per_s if moe else linear_rate
        matmul = 2 * tokens * (attention_params / linear_rate + mlp_params / mlp_rate)
        recompute = op_rerun(moe) if mode == "op" else {"none": 0.0, "selective": core, "full": matmul + core}[mode]
        return matmul + core, matmul + 2 * core + recompute, matmul

    # Under recompute_layers K only the first K layers of each stage rerun in full.
    kept_mode = "none" if layout.recompute == "full" else layout.recompute
    dense_layer, moe_layer = layer(fig.dense_mlp / tp, layout.recompute), layer(fig.moe_active, layout.recompute, True)
    dense_kept, moe_kept = layer(fig.dense_mlp / tp, kept_mode), layer(fig.moe_active, kept_mode, True)
    head = 2 * tokens * h * model.vocab_size / tp / flops_per_s
    tp_pass = tp_edge = 0.0
    if tp > 1:
        tp_edge = links.all_reduce(act_bytes, groups["tp"])  # embedding forward, head input gradient
        tp_pass = 4 * links.gather_or_scatter(act_bytes, groups["tp"]) if layout.sp else 2 * tp_edge
    if cp > 1:
        # The ring (kernels/attention.py), per layer: forward passes the local KV block
        # on cp-1 times; backward passes it on cp-1 times again and the fp32 dK/dV
        # accumulator cp times (the last hop brings it home). Both go to the next rank,
        # so they share the link: during backward step 0 the KV block is in flight,
        # during steps 1..cp-2 a KV block and an accumulator, during step cp-1 an
        # accumulator, each hidden behind that step's block (core/cp forward, 2 core/cp
        # backward); the last accumulator hop is exposed. Full recompute runs the
        # forward ring again; selective keeps the ring's output (one fused kernel).
        rerun = layout.recompute == "full"
        _, k_width, v_width = attention_widths(model)
        kv_elements = tokens * (k_width + v_width) / tp
        kv_hop, grad_hop = links.p2p(kv_elements * c, groups["cp"]), links.p2p(kv_elements * 4, groups["cp"])
        cp_forward = (cp - 1) * max(0.0, kv_hop - core / cp)
        in_flight = [kv_hop] + [kv_hop + grad_hop] * (cp - 2) + [grad_hop]
        cp_backward = sum(max(0.0, t - 2 * core / cp) for t in in_flight) + grad_hop + rerun * cp_forward
        cp_volume = (2 + rerun) * (cp - 1) * kv_hop + cp * grad_hop
    a2a = counts = 0.0
    if layout.ep > 1 and model.moe:
        a2a = links.all_to_all(tokens * model.moe.top_k * h * c, groups["ep"])
        counts = links.all_to_all(8 * model.moe.num_experts, groups["ep"])

    def hybrid_block(kind: str, mode: str) -> tuple[float, float, float]:
        """A hybrid model's block (estimate/mamba.py): its matmuls (an MoE block whole under TP)
        and its core; the scan's backward runs its chunks again (runtime/mamba.py's SSDScan)."""
        split = 1 if kind == "moe" else tp
        matmul = 2 * tokens * mamba.block_matmul_params(model, kind) / split / (flops_per_s if kind == "moe"
                                                                               else linear_rate)
        own = tokens * mamba.block_core_flops(model, kind) / 3 / tp / flops_per_s
        rerun = own if kind == "mamba" else 0.0
        recompute = {"none": 0.0, "selective": own if kind == "attention" else 0.0, "op": matmul / 2,
                     "full": matmul + own}[mode]
        return matmul + own, matmul + 2 * own + rerun + recompute, matmul

    works = []
    for shape in shapes:
        work, layers = MicrobatchWork(), shape.layers
        rebuilt = full_recompute_layers(layout, shape) / layers if layout.recompute == "full" and layers else 1.0
        if model.hybrid_pattern is None:
            work.add(dense_layer, rebuilt * (layers - shape.moe_layers))
            work.add(moe_layer, rebuilt * shape.moe_layers)
            work.add(dense_kept, (1 - rebuilt) * (layers - shape.moe_layers))
            work.add(moe_kept, (1 - rebuilt) * shape.moe_layers)
        else:
            for kind, count in mamba.rank_kinds(model, layout, shape.rank).items():
                work.add(hybrid_block(kind, layout.recompute), rebuilt * count)
                work.add(hybrid_block(kind, kept_mode), (1 - rebuilt) * count)
        if shape.last:
            work.add((head, head, head))
        if tp > 1:
            passes = layers / 2 if model.hybrid_pattern is not None else layers  # a hybrid block has one half
            work.add_comm("tp", passes * tp_pass + tp_edge * shape.first,
                          passes * tp_pass * (2 if layout.recompute == "full" else 1) + tp_edge * shape.last)
        if cp > 1:
            work.add_comm("cp", layers * cp_forward, layers * cp_backward, total=layers * cp_volume)
        if a2a and shape.moe_layers:
            again = {"none": 0.0, "selective": 0.0, "op": counts, "full": counts + 2 * a2a}[layout.recompute]
            work.add_comm("ep", (counts + 2 * a2a) * shape.moe_layers, (2 * a2a + again) * shape.moe_layers)
        works.append(work)
    return works


# -- the step ----------------------------------------------------------------------------------

class StepTime(NamedTuple):
    step_s: float
    compute_s: float  # busy time of the slowest pipeline rank (its critical-path communication included)
    bubble_s: float
    comm_s: dict[str, float]  # per dimension, all of it
    exposed_comm_s: dict[str, float]  # per dimension, on the critical path


def step_time(model: ModelConfig, layout: Layout, links: Links, flops_per_s: float, device: str,
              shapes: list[RankShape], linear_flops_per_s: float | None = None) -> StepTime:
    """`shapes`: what the pipeline ranks that can be the slowest hold (the first, the last);
    `linear_flops_per_s`: the blocks' linear layers' rate where it differs (fp8, mxfp8)."""
    prec = precision(model, device)
    m, v = layout.grad_accum(model), stage_chunks(layout)
    groups = mesh_groups(ParallelDims.from_layout(layout))
    # The slowest rank's micro-batch does not depend on data parallel: layouts that differ
    # only in dp, dp_shard or zero share it.
    memo = model_figures(model).peaks
    key = ("work", tuple(map(id, shapes)), links, flops_per_s, linear_flops_per_s, prec.compute, layout.mbs,
           layout.cp, layout.tp,
           layout.sp, layout.recompute, layout.recompute_layers, layout.ep)  # shapes are memoised: one object per shape
    work = memo.get(key)
    if work is None:
        work = memo[key] = max(microbatch_works(model, layout, links, flops_per_s, prec.compute, shapes, groups,
                                                linear_flops_per_s), key=lambda w: w.busy)
    compute = m * work.busy
    bubble = bubble_time(layout, work.forward / v, work.backward_input / v, work.backward_weight / v)
    comm = {dim: m * t for dim, t in work.total.items()}
    exposed = {dim: m * t for dim, t in work.critical.items()}

    # Data parallel. Gradients in fp32 once per step; zero 0 all-reduces them, zero >= 1
    # reduce-scatters over the shard group and all-reduces the shard over replicas (HSDP).
    params = max(shapes, key=lambda s: s.dense_params + s.expert_params)
    grads, expert_grads = prec.grad * params.dense_params, prec.grad * params.expert_params
    shard, expert_shard, replicas = groups["dp_shard_cp"], groups["edp_shard"], groups["dp_replicate"]
    if layout.zero == 0:
        reduce = links.all_reduce(grads, groups["dp_cp"]) + links.all_reduce(expert_grads, groups["edp"])
    else:
        reduce = (links.gather_or_scatter(grads, shard) + links.all_reduce(grads / shard.size, replicas)
                  + links.gather_or_scatter(expert_grads, expert_shard)
                  + links.all_reduce(expert_grads / expert_shard.size, replicas))
        if layout.zero >= 2 and layout.pp == 1:  # FSDP reduce-scatters every micro-batch's gradients
            reduce *= m
    # All-gathers of the working copy: zero 2 once per micro-batch (FSDP2 reshards after
    # each backward), zero 3 twice (forward and backward); under PP once per step.
    gathers = 0 if layout.zero < 2 else 1 if layout.pp > 1 else m * (2 if reshards_after_forward(layout) else 1)
    gather = gathers * (links.gather_or_scatter(prec.compute * params.dense_params, shard)
                        + links.gather_or_scatter(prec.compute * params.expert_params, expert_shard))
    layers = max(1, shapes[0].layers)
    dp_exposed = max(reduce / layers, reduce - work.backward_input - work.backward_weight) if reduce else 0.0
    dp_exposed += max(gather / layers, gather - compute) if gather else 0.0
    if layout.zero == 1:  # each rank updated its shard; the shard group gathers them all
        after_step = (links.gather_or_scatter(prec.compute * params.dense_params, shard)
                      + links.gather_or_scatter(prec.compute * params.expert_params, expert_shard))
        gather += after_step
        dp_exposed += after_step
    if reduce + gather:
        comm["dp"], exposed["dp"] = reduce + gather, dp_exposed
    if layout.pp > 1:
        boundary = layout.mbs * model.seq_len / layout.cp * model.hidden_size * prec.compute
        boundary /= layout.tp if layout.sp else 1
        comm["pp"] = exposed["pp"] = 2 * (v * m + layout.pp - 1) * links.p2p(boundary, groups["pp"])

    step = compute + bubble + exposed.get("dp", 0.0) + exposed.get("pp", 0.0)
    return StepTime(step_s=step, compute_s=compute, bubble_s=bubble, comm_s=comm, exposed_comm_s=exposed)
