"""The estimator's factors fitted to the trials a study has measured (`calibrate`)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from autotune.config import HardwareConfig, ModelConfig
from autotune.estimate.calibration import Calibration, default_calibration
from autotune.estimate.pricing import estimate, trained_model
from autotune.plan.layout import Layout


def calibrate(measured: list[tuple[Layout, dict[str, Any]]], model: ModelConfig, hardware: HardwareConfig,
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
    prior = default_calibration(device, hardware, trained_model(model, device, dtype, grad_dtype).dtype)
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


