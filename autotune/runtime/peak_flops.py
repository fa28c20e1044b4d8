"""The peak FLOP/s per device that MFU divides by, and where that number came from.

In order: `--peak-tflops`; the `--hardware` preset's peak_tflops; on CUDA the preset
matching the device name; otherwise a calibration GEMM timed on this rank. Nothing is
cached across trials: a calibration takes a fraction of a second, and a cached number
would go stale when the machine's load changes.
"""

from __future__ import annotations

import time

import torch

from autotune.config import hardware_for_device_name, load_hardware
from autotune.runtime.profiling import synchronize

CALIBRATION_SIZE = {"cpu": 1024, "cuda": 8192}
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
    n = CALIBRATION_SIZE[device.type]
    return gemm_flops(device, dtype, n), f"calibration: {n}x{n} {str(dtype).removeprefix('torch.')} GEMM, " \
                                        f"best of {CALIBRATION_REPEATS}"


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = CALIBRATION_REPEATS) -> float:
    """FLOP/s of the fastest of `repeats` n x n matmuls (2 n^3 FLOPs each), after one
    untimed matmul that pays for library initialisation. It runs with the thread count the
    trial runs with, on every rank at once, so on a shared CPU it measures each rank's share."""
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
    return 2 * n**3 / best
