"""The peak FLOP/s per device that MFU divides by, and where that number came from.

In order: `--peak-tflops`; the `--hardware` preset's peak_tflops; on CUDA the preset
matching the device name; otherwise a calibration GEMM timed on this rank. Nothing is
cached across trials: a calibration takes about a second at most, and a cached number
would go stale when the machine's load changes.

The GEMM's size is bounded by its time as well as by CALIBRATION_SIZE: it starts at
CALIBRATION_START and doubles while the next size (8x the FLOPs) is expected to take
under CALIBRATION_BUDGET_S. On one core, a CPU without bf16 instructions multiplies
1024x1024 bf16 in about 2.6 s against 0.04 s in fp32 (0.8 GFLOP/s against 50), and one
with them (avx512_bf16) still takes 2.2 s in fp16, so a fixed 1024 cost each such trial
on the CPU some 9-10 s of calibration; bounded, it costs at most about a second (the
sizing GEMMs, then the timed ones) and the rate is measured where the machine spends it.
"""

from __future__ import annotations

import time

import torch

from autotune.config import hardware_for_device_name, load_hardware
from autotune.runtime.profiling import synchronize

CALIBRATION_SIZE = {"cpu": 1024, "cuda": 8192}  # the largest GEMM calibrated on each device
CALIBRATION_START = 256
CALIBRATION_BUDGET_S = 0.25  # the most one calibration GEMM of a grown size is expected to take
CALIBRATION_REPEATS = 3


def peak_flops(peak_tflops: float | None, hardware: str | None, device: torch.device,
               dtype: torch.dtype) -> tuple[float, str]:
    """(FLOP/s of one device, where that number came from)."""
    if peak_tflops:
        return peak_tflops * 1e12, "--peak-tflops"
    if hardware:
        preset = load_hardware(hardware)
        if preset.peak_tflops > 0:
            return preset.peak_tflops * 1e12, f"hardware preset {preset.name}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        preset = hardware_for_device_name(name)
        if preset is not None:
            return preset.peak_tflops * 1e12, f"hardware preset {preset.name} (device {name})"
    n = calibration_size(device, dtype)
    return gemm_flops(device, dtype, n), f"calibration: {n}x{n} {str(dtype).removeprefix('torch.')} GEMM, " \
                                        f"best of {CALIBRATION_REPEATS}"


def calibration_size(device: torch.device, dtype: torch.dtype) -> int:
    """The GEMM size to calibrate with: from CALIBRATION_START, doubled while 8x the time of
    one GEMM at the current size stays under CALIBRATION_BUDGET_S, up to CALIBRATION_SIZE."""
    n, largest = CALIBRATION_START, CALIBRATION_SIZE[device.type]
    while n < largest and 8 * gemm_seconds(device, dtype, n) <= CALIBRATION_BUDGET_S:
        n *= 2
    return n


def gemm_seconds(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 1) -> float:
    """Wall time of the fastest of `repeats` n x n matmuls, after one untimed matmul that
    pays for library initialisation. It runs with the thread count the trial runs with, on
    every rank at once, so on a shared CPU it measures each rank's share."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = CALIBRATION_REPEATS) -> float:
    """FLOP/s of the fastest of `repeats` n x n matmuls: 2 n^3 FLOPs each."""
    return 2 * n**3 / gemm_seconds(device, dtype, n, repeats)
