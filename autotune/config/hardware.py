"""Hardware descriptions: a device's peaks, memory, hosts and links, from a preset or a YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from autotune.config.files import build, positive, read_mapping, resolve_file
from autotune.errors import UsageError

HARDWARE_DIR = Path(__file__).resolve().parent.parent / "hardware"


@dataclass(frozen=True)
class HardwareConfig:
    """What a device and its cluster can do: the numbers the estimator, MFU and the layout rules need.

    Two domains matter and they are not the same on rack-scale systems: the host (a machine
    and its GPUs, what a launcher starts processes on) and the scale-up domain (the GPUs that
    share NVLink or Infinity Fabric). On an HGX/DGX or an MI300X platform both are 8 GPUs; on
    a GB200 or GB300 NVL72 rack a host holds 4 GPUs and the NVLink domain spans all 72 of the
    rack. "Inside a node" in the layout rules, the estimator and the report means inside the
    scale-up domain: that is where TP's all-reduces and EP's all-to-alls are cheap.
    """

    name: str
    peak_tflops: float  # dense bf16 (fp32 for cpu), per device: MFU's denominator; 0 = measure by calibration
    memory_gb: float  # GiB per device; 0 = no limit known (the CPU)
    gpus_per_host: int  # processes a launcher starts on one machine
    scale_up_gpus: int  # GPUs that share NVLink / Infinity Fabric (NVL72: 72); a multiple of gpus_per_host
    scale_up_gbps: float  # GB/s per device, one direction, inside the scale-up domain
    scale_out_gbps: float  # GB/s per device, one direction, between scale-up domains (InfiniBand/RoCE)
    # Dense peak TFLOP/s per device by precision (bf16, fp16, fp8, mxfp8, fp32, tf32: those it
    # has). Empty: every precision at peak_tflops (a custom YAML, the calibrated CPU). Left out
    # of the hash (a dict is not hashable); equality still compares it.
    dense_tflops: dict = dataclasses.field(default_factory=dict, hash=False)
    # The fraction of a precision's dense peak that training in it reaches on this device,
    # fitted to published runs (benchmarks/published_runs.py): bf16, fp16, fp32 all of the
    # compute (estimate.Calibration.compute_efficiency); fp8, mxfp8 the 8-bit linears (the rest
    # runs at the bf16 entry). A precision left out keeps the prior. Left out of the hash as
    # dense_tflops is.
    compute_efficiency: dict = dataclasses.field(default_factory=dict, hash=False)

    def validate(self) -> "HardwareConfig":
        positive("gpus_per_host", self.gpus_per_host)
        positive("scale_up_gpus", self.scale_up_gpus)
        if self.scale_up_gpus % self.gpus_per_host:
            raise UsageError(f"scale_up_gpus: must be a multiple of gpus_per_host ({self.gpus_per_host}), "
                             f"got {self.scale_up_gpus}")
        for name in ("scale_up_gbps", "scale_out_gbps"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name}: must be a positive number, got {getattr(self, name)}")
        for name in ("peak_tflops", "memory_gb"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for precision, tflops in self.dense_tflops.items():
            if precision not in HARDWARE_PRECISIONS:
                raise UsageError(f"dense_tflops.{precision}: unknown precision "
                                 f"(known: {', '.join(HARDWARE_PRECISIONS)})")
            if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or tflops <= 0:
                raise UsageError(f"dense_tflops.{precision}: must be a positive number, got {tflops!r}")
        for precision, efficiency in self.compute_efficiency.items():
            if precision not in HARDWARE_PRECISIONS:
                raise UsageError(f"compute_efficiency.{precision}: unknown precision "
                                 f"(known: {', '.join(HARDWARE_PRECISIONS)})")
            if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
                raise UsageError(f"compute_efficiency.{precision}: must be a number in (0, 1], got {efficiency!r}")
        return self

    def matmul_tflops(self, dtype: str) -> float:
        """Dense peak of the matmuls of a model trained in `dtype` (DTYPES): fp8 and mxfp8 run
        their linear layers' GEMMs at the device's fp8 or MX rate, fp32 at its fp32 rate (the
        runtime leaves torch's float32 matmuls in full fp32, not TF32). A device without that
        precision refuses, in one line."""
        if not self.dense_tflops:
            return self.peak_tflops
        if dtype not in self.dense_tflops:
            raise UsageError(f"dtype: {self.name} has no {dtype} (it has {', '.join(self.dense_tflops)})")
        return float(self.dense_tflops[dtype])

    def with_gpus_per_host(self, gpus: int) -> "HardwareConfig":
        """--gpus-per-node: hosts of `gpus` GPUs. Where the scale-up domain is the host (HGX,
        MI300X, the CPU), the domain shrinks or grows with it; a rack-scale domain (NVL72)
        stays as it is."""
        domain = gpus if self.scale_up_gpus == self.gpus_per_host else self.scale_up_gpus
        return dataclasses.replace(self, gpus_per_host=gpus, scale_up_gpus=domain)


# Precisions a hardware preset may list (tf32: the tensor-core rate of fp32 inputs, for reference).
HARDWARE_PRECISIONS = ("bf16", "fp16", "fp8", "mxfp8", "fp32", "tf32")
# A hardware description written before scale-up domains: its names -> today's.
_HARDWARE_ALIASES = {"gpus_per_node": "gpus_per_host", "intra_node_gbps": "scale_up_gbps",
                     "inter_node_gbps": "scale_out_gbps"}


def hardware_from_dict(data: dict) -> HardwareConfig:
    """A hardware description (a YAML's fields, or a stored study's): older names accepted,
    the scale-up domain defaulting to the host."""
    data = dict(data)
    for old, new in _HARDWARE_ALIASES.items():
        if old in data:
            if new in data:
                raise UsageError(f"{old}: give {new} only (it replaces {old})")
            data[new] = data.pop(old)
    if "gpus_per_host" in data:
        data.setdefault("scale_up_gpus", data["gpus_per_host"])
    mappings = {}
    for name, what in (("dense_tflops", "TFLOP/s"), ("compute_efficiency", "fraction")):
        mappings[name] = data.pop(name, None) or {}
        if not isinstance(mappings[name], dict):
            raise UsageError(f"{name}: must be a mapping of precision: {what}, got {type(mappings[name]).__name__}")
    return dataclasses.replace(build(HardwareConfig, data), **{k: dict(v) for k, v in mappings.items()}).validate()



def hardware_presets() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(spec: str) -> HardwareConfig:
    path = resolve_file(spec, HARDWARE_DIR, "hardware", hardware_presets())
    data = read_mapping(path)
    data.setdefault("name", path.stem)
    return hardware_from_dict(data)


def hardware_for_device_name(device_name: str) -> HardwareConfig | None:
    """The preset for a device name such as 'NVIDIA H100 80GB HBM3' or 'AMD Instinct MI300X', if
    we know it (a Grace-Blackwell GPU names itself GB200/GB300: checked before B200/B300)."""
    upper = device_name.upper()
    for key, preset in (("GB300", "gb300"), ("GB200", "gb200"), ("B300", "b300"), ("B200", "b200"),
                        ("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"),
                        ("MI355X", "mi355x"), ("MI300X", "mi300x")):
        if key in upper:
            return load_hardware(preset)
    return None

