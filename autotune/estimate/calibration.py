"""The estimator's factors: priors per device, and what published runs reached per GPU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotune.config import HardwareConfig
from autotune.errors import UsageError
from autotune.estimate.memory import DEVICES


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
