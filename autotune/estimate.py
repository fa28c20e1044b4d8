"""Price a layout without launching it: peak memory per rank and step time.

The study prunes layouts that cannot fit before they waste a launch, ranks
candidates, and answers "what if" for clusters the user does not have. Pure Python
(no torch import), so it prices thousands of layouts a second.

It models what our runtime does, not a generic framework: estimate_memory.py says
which runtime behaviour each memory term mirrors, estimate_time.py the FLOP and
communication accounting and its overlap assumptions. This module assembles them,
fits them to measured trials (`calibrate`), lists every layout of a space
(`every_layout`), prices the listing (`price_every_layout`, which counts without building
the layouts whose state alone is over the budget) and ranks it (`rank_estimates`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass, field

from autotune.config import GIB, HardwareConfig, ModelConfig, as_trained, per_model_object
from autotune.errors import UsageError
from autotune.estimate_memory import DEVICES, TERMS, model_figures, pipeline_shapes, rank_terms, state_floor
from autotune.estimate_time import Links, step_time
from autotune.layout import Layout, enumerate_layouts, enumerate_layouts_skipping
from autotune.schedules import SCHEDULES


@dataclass(frozen=True)
class Calibration:
    """Factors fitted from measured trials by `calibrate`; `default_calibration` gives priors.

    compute_efficiency: achieved fraction of the hardware's peak FLOP/s over all the
    computation (matmuls, attention, memory-bound elementwise ops);
    bandwidth_efficiency: achieved fraction of link bandwidth; latency_s: fixed cost of
    one collective or transfer; memory: measured peak = memory_scale * modelled +
    memory_offset_bytes (identity by default); linear_8bit_efficiency: the fraction of
    compute_efficiency that fp8 / mxfp8 linears reach of their 8-bit peak (their casts,
    amax reductions and scales are memory-bound work the bf16 GEMM does not have).
    """

    compute_efficiency: float = 0.55
    # A prior, not yet fitted: 0.6 makes Llama 3 8B on 8 H100s (zero 1, selective recompute)
    # 1.13x faster in fp8 than in bf16, within what torchtitan published for float8 training
    # of that model there: 1.11x rowwise, 1.25x tensorwise with fp8 all-gathers (commit
    # 7a04053 of github.com/pytorch/torchtitan, "example of float8 with rowwise scaling").
    linear_8bit_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.75
    memory_scale: float = 1.0
    memory_offset_bytes: float = 0.0
    latency_s: float = 2e-5
    trials_used: int = 0


# Priors: bf16 training on current GPUs reaches about 55% of peak and NCCL about 75% of
# link speed; the CPU runtime's small ops reach about half of a calibration GEMM's
# speed, and a gloo collective costs about 100 us.
_PRIORS = {"cuda": Calibration(), "cpu": Calibration(compute_efficiency=0.5, bandwidth_efficiency=0.5, latency_s=1e-4)}


def default_calibration(device: str, hardware: HardwareConfig | None = None, dtype: str | None = None) -> Calibration:
    """The device's prior; on CUDA, what published runs reached on that hardware where its
    preset says (HardwareConfig.compute_efficiency): the precision's own fraction of its peak,
    and for fp8 / mxfp8 the bf16 one for the rest of the compute, the 8-bit one for the
    linears (linear_8bit_efficiency = 8-bit / bf16, as Calibration counts it)."""
    if device not in DEVICES:
        raise UsageError(f"device: must be one of {', '.join(DEVICES)}, got {device!r}")
    prior = _PRIORS[device]
    fitted = hardware.compute_efficiency if hardware is not None and device == "cuda" else {}
    eight_bit = dtype in ("fp8", "mxfp8")
    base = fitted.get("bf16" if eight_bit else dtype, prior.compute_efficiency)
    linear = fitted[dtype] / base if eight_bit and dtype in fitted else prior.linear_8bit_efficiency
    if (base, linear) == (prior.compute_efficiency, prior.linear_8bit_efficiency):
        return prior
    return dataclasses.replace(prior, compute_efficiency=base, linear_8bit_efficiency=linear)


@dataclass
class Estimate:
    """One layout, priced: memory of its worst rank, and its step time.

    Fields named as a trial's (step_time_s, tokens_per_s, mfu, peak_mem_bytes) mean
    what the trial's mean; the time fields are NaN when the hardware's peak FLOP/s is
    unknown."""

    layout: Layout
    peak_mem_bytes: float  # worst rank
    memory: dict[str, float]  # the worst rank at its peak, by term; sums to peak_mem_bytes:
    # estimate_memory.TERMS: params, master_params, grads, optimizer, gathered_params, activations,
    # pipeline_buffers, logits, temporaries, overhead
    step_time_s: float
    tokens_per_s: float
    mfu: float
    comm_fraction: float  # exposed communication / step time (a trial's exposed_comm_fraction)
    bubble_fraction: float  # pipeline idle time / step time
    fits: bool  # peak_mem_bytes <= budget (True when there is no budget)
    memory_budget_bytes: float | None = None
    device: str = "cuda"
    worst_pp_rank: int = 0
    peak_phase: str = "loss_backward"  # or "layer_backward", "optimizer_step", "backward_end": estimate_memory
    grad_accum: int = 1
    tokens_per_s_per_gpu: float = 0.0
    compute_s: float = 0.0  # busy time of the slowest pipeline rank, its TP/CP/EP communication included
    bubble_s: float = 0.0
    total_comm_fraction: float = 0.0  # all communication, hidden or not / step time (a trial's comm_fraction)
    comm_s: dict[str, float] = field(default_factory=dict)  # per dimension, all of it
    exposed_comm_s: dict[str, float] = field(default_factory=dict)  # per dimension, on the critical path

    def to_dict(self) -> dict:
        """JSON-ready: the layout as its string, unknown (NaN) figures as None. Field by
        field, not dataclasses.asdict (which deep-copies, the Layout too): a listing turns
        tens of thousands of estimates into JSON."""
        out = {f.name: _json_safe(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["layout"] = self.layout.text
        out["layout_short"] = self.layout.short()
        return out


def _json_safe(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def estimate(model: ModelConfig, layout: Layout, hardware: HardwareConfig, memory_budget_bytes: float | None = None,
             calibration: Calibration | None = None, device: str = "cuda", dtype: str | None = None,
             grad_dtype: str | None = None, time_over_budget: bool = True) -> Estimate:
    """Price one layout (valid: see layout.check) of `model` on `hardware`.

    The precision is the one the trial trains in (config.trained_dtype): `dtype`, else the
    model's on CUDA, fp32 on the CPU; the gradients' is `grad_dtype`, else the model's
    (config.trained_grad_dtype). Time needs hardware.peak_tflops; where it is 0 (the
    CPU preset: measured at run time) the time fields are NaN and memory is still
    estimated. `time_over_budget=False` leaves them NaN too where the layout does not fit
    the budget: a listing of every layout ranks those by memory alone.

    Compute runs at the device's dense peak for the precision (HardwareConfig.dense_tflops):
    fp8 and mxfp8 run the blocks' linear layers at the fp8 / MX rate and the rest (the
    attention core, MoE experts, the head, the elementwise ops) at bf16's; communication is
    never in 8 bits. A device without the precision refuses (one line). MFU is measured
    against the dense bf16 peak (hardware.peak_tflops) whatever the precision, as vendors'
    tables and published runs report it, so an fp8 run can show more MFU than bf16 can reach.
    """
    model = _trained(model, device, dtype, grad_dtype)
    base_tflops, linear_tflops = precision_tflops(hardware, model.dtype)
    cal = calibration or default_calibration(device, hardware, model.dtype)
    shapes = pipeline_shapes(model, layout)
    peak, worst_rank, phase, terms = -1.0, 0, "", ()
    for shape in shapes:
        for rank_phase, bytes_by_term in rank_terms(model, layout, device, shape).items():
            total = sum(bytes_by_term)
            if total > peak:
                peak, worst_rank, phase, terms = total, shape.rank, rank_phase, bytes_by_term
    memory = dict(zip(TERMS, terms))
    if cal.memory_scale != 1.0 or cal.memory_offset_bytes:
        memory = {term: cal.memory_scale * b for term, b in memory.items()}
        memory["overhead"] += cal.memory_offset_bytes
        peak = sum(memory.values())
    fits = memory_budget_bytes is None or peak <= memory_budget_bytes
    common = dict(layout=layout, peak_mem_bytes=peak, memory=memory, fits=fits, memory_budget_bytes=memory_budget_bytes,
                  device=device, worst_pp_rank=worst_rank, peak_phase=phase, grad_accum=layout.grad_accum(model))
    if not hardware.peak_tflops or not (fits or time_over_budget):
        nan = math.nan
        return Estimate(step_time_s=nan, tokens_per_s=nan, mfu=nan, comm_fraction=nan, bubble_fraction=nan,
                        tokens_per_s_per_gpu=nan, compute_s=nan, bubble_s=nan, total_comm_fraction=nan, **common)
    peak_flops = hardware.peak_tflops * 1e12
    links = Links(hardware, cal.bandwidth_efficiency, cal.latency_s)
    efficiency = cal.compute_efficiency * 1e12
    time = step_time(model, layout, links, base_tflops * efficiency, device, slowest_candidates(shapes),
                     linear_flops_per_s=linear_tflops * efficiency * cal.linear_8bit_efficiency
                     if linear_tflops != base_tflops else None)
    tokens_per_s = model.global_batch_size * model.seq_len / time.step_s
    # MFU as a trial measures it: model FLOPs per token (no recompute) over the dense bf16 peak.
    mfu = model_figures(model).flops_per_token * tokens_per_s / (layout.world_size * peak_flops)
    return Estimate(
        step_time_s=time.step_s, tokens_per_s=tokens_per_s, mfu=mfu,
        comm_fraction=sum(time.exposed_comm_s.values()) / time.step_s, bubble_fraction=time.bubble_s / time.step_s,
        tokens_per_s_per_gpu=tokens_per_s / layout.world_size, compute_s=time.compute_s, bubble_s=time.bubble_s,
        total_comm_fraction=sum(time.comm_s.values()) / time.step_s, comm_s=time.comm_s,
        exposed_comm_s=time.exposed_comm_s, **common)


def precision_tflops(hardware: HardwareConfig, dtype: str) -> tuple[float, float]:
    """(the rate of everything, the rate of the blocks' linear layers) in TFLOP/s for a model
    trained in `dtype`: fp8 and mxfp8 compute in bf16 but for those linears; the others are
    their own rate throughout. Raises a UsageError where the hardware lacks the precision."""
    linear = hardware.matmul_tflops(dtype)
    base = hardware.matmul_tflops("bf16") if dtype in ("fp8", "mxfp8") else linear
    return base, linear


@per_model_object
def _trained(model: ModelConfig, device: str, dtype: str | None, grad_dtype: str | None) -> ModelConfig:
    """as_trained, one object per (model, device, dtype, grad_dtype): the estimator memoises
    its per-model figures by the model object (estimate_memory.model_figures)."""
    trained = as_trained(model, device, dtype, grad_dtype)
    return model if trained == model else trained


@functools.lru_cache(maxsize=1024)
def slowest_candidates(shapes: tuple) -> list:
    """The pipeline ranks that can be the slowest: those with an end of the model (the
    embedding, the head), and the middle one with the most layers if it has more than
    either end (equal layers and no end make a middle rank no slower)."""
    ends = [s for s in shapes if s.first or s.last]
    most = max((s.layers, s.moe_layers) for s in ends)
    middle = [s for s in shapes if not (s.first or s.last) and (s.layers, s.moe_layers) > most]
    return ends + sorted(middle, key=lambda s: (s.layers, s.moe_layers))[-1:]


# -- calibration from measured trials ------------------------------------------------------------

def calibrate(measured: list[tuple[Layout, dict]], model: ModelConfig, hardware: HardwareConfig,
              device: str = "cuda", dtype: str | None = None, grad_dtype: str | None = None) -> Calibration:
    """Fit the factors to trials measured in a study, so predictions improve as it runs.

    `measured`: (layout, trial JSON) pairs; the complete ones count, and those pruned
    as comm_bound (their figures are kept). Each time factor is the prior times the
    median over trials of predicted / measured time, which one outlier cannot drag:
      compute_efficiency:   time not spent communicating, step_time_s * (1 - exposed_comm_fraction)
      bandwidth_efficiency: time spent communicating, step_time_s * comm_fraction
    Memory is the least-squares line measured = scale * predicted + offset over
    peak_mem_bytes (a median ratio when fewer than three predictions spread). A factor
    without usable trials keeps its prior.
    """
    prior = default_calibration(device, hardware, _trained(model, device, dtype, grad_dtype).dtype)
    usable = [(layout, t) for layout, t in measured if t.get("status") == "complete" or t.get("reason") == "comm_bound"]
    compute_ratios, bandwidth_ratios, memory_points = [], [], []
    for layout, trial in usable:
        predicted = estimate(model, layout, hardware, calibration=prior, device=device, dtype=dtype,
                             grad_dtype=grad_dtype)
        step = trial.get("step_time_s")
        if step and not math.isnan(predicted.step_time_s):
            computing = predicted.compute_s + predicted.bubble_s - sum(
                predicted.exposed_comm_s.get(dim, 0.0) for dim in ("tp", "cp", "ep"))
            measured_computing = step * (1 - (trial.get("exposed_comm_fraction") or 0.0))
            if computing > 0 and measured_computing > 0:
                compute_ratios.append(computing / measured_computing)
            communicating = sum(predicted.comm_s.values())
            measured_communicating = step * (trial.get("comm_fraction") or 0.0)
            if communicating > 0 and measured_communicating > 0:
                bandwidth_ratios.append(communicating / measured_communicating)
        if trial.get("peak_mem_bytes"):
            memory_points.append((predicted.peak_mem_bytes, float(trial["peak_mem_bytes"])))
    scale, offset = _fit_line(memory_points)
    return Calibration(
        compute_efficiency=prior.compute_efficiency * statistics.median(compute_ratios)
        if compute_ratios else prior.compute_efficiency,
        bandwidth_efficiency=prior.bandwidth_efficiency * statistics.median(bandwidth_ratios)
        if bandwidth_ratios else prior.bandwidth_efficiency,
        memory_scale=scale, memory_offset_bytes=offset, latency_s=prior.latency_s,
        linear_8bit_efficiency=prior.linear_8bit_efficiency, trials_used=len(usable))


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(scale, offset) with measured = scale * predicted + offset."""
    if not points:
        return 1.0, 0.0
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if len(points) < 3 or spread <= len(points) * (0.05 * mean_x) ** 2:
        return statistics.median(y / x for x, y in points), 0.0
    scale = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return scale, mean_y - scale * mean_x


# -- every layout of a space ---------------------------------------------------------------------

def reasonable_space(model: ModelConfig, gpus: int, gpus_per_node: int) -> list[dict]:
    """Sub-spaces covering every dimension, each with schedules and vpp that agree (so
    few combinations are built only to be rejected): tp, pp, cp and ep powers of two
    within their limits (tp in a node, cp at most 16), dp_shard = dp or one node (HSDP),
    zero 0-3, mbs 1, 2, 4, every recompute mode, sp on and off."""
    def powers(limit: int) -> list[int]:
        return [2**i for i in range(limit.bit_length()) if 2**i <= limit]

    base = {"tp": powers(min(gpus, gpus_per_node)), "pp": powers(min(gpus, model.num_layers)),
            "cp": powers(min(gpus, 16, model.seq_len // 2)),
            "ep": powers(min(gpus, model.moe.num_experts)) if model.moe else [1],
            "dp_shard": ["dp"] + ([gpus_per_node] if gpus_per_node < gpus else []),
            "zero": [0, 1, 2, 3], "mbs": [1, 2, 4], "recompute": ["none", "selective", "op", "full"],
            "recompute_layers": [0, 2, 4], "sp": [0, 1]}
    pipelined = [p for p in base["pp"] if p > 1]
    by_vpp: dict[tuple[int, ...], list[str]] = {}
    for schedule in SCHEDULES.values():
        by_vpp.setdefault(schedule.vpp_choices, []).append(schedule.name)
    return [{**base, "schedule": names, "vpp": list(vpps)} if vpps == (1,) else
            {**base, "pp": pipelined, "schedule": names, "vpp": list(vpps)} for vpps, names in by_vpp.items()]


def every_layout(model: ModelConfig, gpus: int, gpus_per_node: int, spaces: list[dict] | None = None) -> list[Layout]:
    """Every valid layout of the spaces (default: `reasonable_space`), each once."""
    layouts: dict[Layout, None] = {}
    for space in spaces or reasonable_space(model, gpus, gpus_per_node):
        layouts.update(dict.fromkeys(enumerate_layouts(model, gpus, space, gpus_per_node)))
    return list(layouts)


def price_every_layout(model: ModelConfig, gpus: int, hardware: HardwareConfig, memory_budget_bytes: float | None,
                       device: str = "cuda", dtype: str | None = None, grad_dtype: str | None = None
                       ) -> tuple[list[Estimate], int, int]:
    """(the estimates of the valid layouts of `reasonable_space` that may fit, how many valid
    layouts there are, how many of them were not priced because their state alone is over
    the budget: estimate_memory.state_floor). On a large model most layouts of a cluster
    are such (deepseek-v3 on 256 H100s: 246,432 of 272,494); the enumeration counts them
    without building them, one floor per combination of the keys the state depends on.
    The count is exact because reasonable_space's sub-spaces share no layout (they differ
    in schedule where pp > 1, and one holds pp = 1). A layout priced over the budget gets
    its memory and no time (NaN): ranked after those that fit, by memory."""
    trained = _trained(model, device, dtype, grad_dtype)

    def over_budget(layout: Layout) -> bool:
        return memory_budget_bytes is not None and state_floor(trained, layout, device) > memory_budget_bytes

    layouts, skipped = {}, 0
    for space in reasonable_space(model, gpus, hardware.scale_up_gpus):
        kept, over = enumerate_layouts_skipping(model, gpus, space, hardware.scale_up_gpus, over_budget)
        layouts.update(dict.fromkeys(kept))
        skipped += over
    priced = [estimate(model, layout, hardware, memory_budget_bytes, device=device, dtype=dtype,
                       grad_dtype=grad_dtype, time_over_budget=False) for layout in layouts]
    return priced, len(layouts) + skipped, skipped


def rank_estimates(estimates: list[Estimate]) -> list[Estimate]:
    """Layouts that fit first, then the predicted OOMs; each by predicted tokens/s,
    fastest first (by peak memory where time is unknown)."""
    def key(e: Estimate):
        return (not e.fits, -(0.0 if math.isnan(e.tokens_per_s) else e.tokens_per_s), e.peak_mem_bytes)
    return sorted(estimates, key=key)


def budget_bytes(hardware: HardwareConfig, memory_budget_gb: float | None) -> float | None:
    """--memory-budget-gb, else the hardware's memory, else none (the CPU preset)."""
    if memory_budget_gb is not None:
        return memory_budget_gb * GIB
    return hardware.memory_gb * GIB if hardware.memory_gb else None
