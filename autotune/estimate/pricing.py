"""Price a layout without launching it: peak memory per rank and step time.

The study prunes layouts that cannot fit before they waste a launch, ranks
candidates, and answers "what if" for clusters the user does not have. Pure Python
(no torch import), so it prices thousands of layouts a second.

It models what our runtime does, not a generic framework: memory.py says which runtime
behaviour each memory term mirrors, step_time.py the FLOP and communication accounting and
its overlap assumptions. This module assembles them into one Estimate per layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from autotune.config import GIB, HardwareConfig, ModelConfig, as_trained, per_model_object
from autotune.estimate.calibration import Calibration, default_calibration
from autotune.estimate.memory import TERMS, model_figures, pipeline_shapes, rank_terms
from autotune.estimate.step_time import Links, step_time
from autotune.plan.layout import Layout


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the layout as its string, unknown (NaN) figures as None. Field by
        field, not dataclasses.asdict (which deep-copies, the Layout too): a listing turns
        tens of thousands of estimates into JSON."""
        out = {f.name: _json_safe(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["layout"] = self.layout.text
        out["layout_short"] = self.layout.short()
        return out


def _json_safe(value: Any) -> Any:
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
    model = trained_model(model, device, dtype, grad_dtype)
    base_tflops, linear_tflops = precision_tflops(hardware, model.dtype)
    cal = calibration or default_calibration(device, hardware, model.dtype)
    shapes = pipeline_shapes(model, layout)
    peak, worst_rank, phase = -1.0, 0, ""
    terms: tuple[float, ...] = ()
    for shape in shapes:
        for rank_phase, bytes_by_term in rank_terms(model, layout, device, shape).items():
            total = sum(bytes_by_term)
            if total > peak:
                peak, worst_rank, phase, terms = total, shape.rank, rank_phase, bytes_by_term
    memory: dict[str, float] = dict(zip(TERMS, terms))
    if cal.memory_scale != 1.0 or cal.memory_offset_bytes:
        memory = {term: cal.memory_scale * b for term, b in memory.items()}
        memory["overhead"] += cal.memory_offset_bytes
        peak = sum(memory.values())
    fits = memory_budget_bytes is None or peak <= memory_budget_bytes

    def priced(**time: Any) -> Estimate:
        return Estimate(layout=layout, peak_mem_bytes=peak, memory=memory, fits=fits,
                        memory_budget_bytes=memory_budget_bytes, device=device, worst_pp_rank=worst_rank,
                        peak_phase=phase, grad_accum=layout.grad_accum(model), **time)

    if not hardware.peak_tflops or not (fits or time_over_budget):
        nan = math.nan
        return priced(step_time_s=nan, tokens_per_s=nan, mfu=nan, comm_fraction=nan, bubble_fraction=nan,
                      tokens_per_s_per_gpu=nan, compute_s=nan, bubble_s=nan, total_comm_fraction=nan)
    peak_flops = hardware.peak_tflops * 1e12
    links = Links(hardware, cal.bandwidth_efficiency, cal.latency_s)
    efficiency = cal.compute_efficiency * 1e12
    time = step_time(model, layout, links, base_tflops * efficiency, device, slowest_candidates(shapes),
                     linear_flops_per_s=linear_tflops * efficiency * cal.linear_8bit_efficiency
                     if linear_tflops != base_tflops else None)
    tokens_per_s = model.global_batch_size * model.seq_len / time.step_s
    # MFU as a trial measures it: model FLOPs per token (no recompute) over the dense bf16 peak.
    mfu = model_figures(model).flops_per_token * tokens_per_s / (layout.world_size * peak_flops)
    return priced(
        step_time_s=time.step_s, tokens_per_s=tokens_per_s, mfu=mfu,
        comm_fraction=sum(time.exposed_comm_s.values()) / time.step_s, bubble_fraction=time.bubble_s / time.step_s,
        tokens_per_s_per_gpu=tokens_per_s / layout.world_size, compute_s=time.compute_s, bubble_s=time.bubble_s,
        total_comm_fraction=sum(time.comm_s.values()) / time.step_s, comm_s=time.comm_s,
        exposed_comm_s=time.exposed_comm_s)


def precision_tflops(hardware: HardwareConfig, dtype: str) -> tuple[float, float]:
    """(the rate of everything, the rate of the blocks' linear layers) in TFLOP/s for a model
    trained in `dtype`: fp8 and mxfp8 compute in bf16 but for those linears; the others are
    their own rate throughout. Raises a UsageError where the hardware lacks the precision."""
    linear = hardware.matmul_tflops(dtype)
    base = hardware.matmul_tflops("bf16") if dtype in ("fp8", "mxfp8") else linear
    return base, linear


@per_model_object
def trained_model(model: ModelConfig, device: str, dtype: str | None, grad_dtype: str | None) -> ModelConfig:
    """as_trained, one object per (model, device, dtype, grad_dtype): the estimator memoises
    its per-model figures by the model object (memory.model_figures)."""
    trained = as_trained(model, device, dtype, grad_dtype)
    return model if trained == model else trained


@functools.lru_cache(maxsize=1024)
def slowest_candidates(shapes: tuple[Any, ...]) -> list[Any]:
    """The pipeline ranks that can be the slowest: those with an end of the model (the
    embedding, the head), and the middle one with the most layers if it has more than
    either end (equal layers and no end make a middle rank no slower)."""
    ends = [s for s in shapes if s.first or s.last]
    most = max((s.layers, s.moe_layers) for s in ends)
    middle = [s for s in shapes if not (s.first or s.last) and (s.layers, s.moe_layers) > most]
    return ends + sorted(middle, key=lambda s: (s.layers, s.moe_layers))[-1:]



def budget_bytes(hardware: HardwareConfig, memory_budget_gb: float | None) -> float | None:
    """--memory-budget-gb, else the hardware's memory, else none (the CPU preset)."""
    if memory_budget_gb is not None:
        return memory_budget_gb * GIB
    return hardware.memory_gb * GIB if hardware.memory_gb else None
