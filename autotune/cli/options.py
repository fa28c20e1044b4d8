"""What the commands share: the parser whose usage errors are one line, the argument types,
the option groups of everything that runs trials, the hardware a device defaults to."""

from __future__ import annotations

import argparse
import subprocess

from rich.console import Console

from autotune.config import DTYPES, GRAD_DTYPES, hardware_for_device_name, hardware_presets, parse_dtype
from autotune.errors import UsageError
from autotune.launch.launchers import LAUNCHERS

stderr = Console(stderr=True)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (never the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def dtype_option(text: str) -> str:
    """--dtype as people write it (bfloat16, float32, fp8_e4m3, ...), in its canonical name."""
    try:
        return parse_dtype(text, "--dtype")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--dtype: ")) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def host_list(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(","))
    if not all(hosts):
        raise argparse.ArgumentTypeError(f"must be host names separated by commas, got {text!r}")
    return hosts


def add_launcher_options(p: argparse.ArgumentParser, default: str | None = "local") -> None:
    """How a trial's processes start; docs/layouts-and-sweep.md, "Sweeps on several machines"."""
    p.add_argument("--launcher", choices=LAUNCHERS, default=default,
                   help="local: every rank here (torchrun --standalone); torchrun: one agent per node of --hosts, "
                        "c10d rendezvous; slurm: one srun step per trial in the current allocation"
                        + (f" (default {default})" if default else " (default: the study's)"))
    p.add_argument("--hosts", type=host_list, default=(), metavar="H1,H2,...",
                   help="the nodes of a multi-node trial, first one hosting the rendezvous: localhost or this "
                        "machine's name run here, others over ssh (slurm default: the allocation's nodes)")


def add_trial_options(p: argparse.ArgumentParser) -> None:
    """Options shared by everything that runs trials."""
    p.add_argument("--steps", type=positive_int, default=5, help="measured optimizer steps (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="unmeasured steps first (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where ranks run (default cpu)")
    p.add_argument("--memory-budget-gb", type=positive_float, default=None,
                   help="a measured peak above this is an OOM (default: the device's memory; none on CPU)")
    p.add_argument("--hardware", default=None,
                   help=f"hardware preset or YAML ({', '.join(hardware_presets())}); default from the device")
    add_dtype_option(p)


def add_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, type=dtype_option, metavar="|".join(DTYPES),
                   help="train in this precision instead of the model's (default: the model's on CUDA, fp32 on the "
                        "CPU; --dtype bf16 on the CPU runs the GPU's mixed-precision plan)")
    p.add_argument("--grad-dtype", default=None, choices=GRAD_DTYPES, metavar="|".join(GRAD_DTYPES),
                   help="accumulate, reduce and keep gradients in this precision: fp32, or the compute dtype, "
                        "as Megatron-LM without grad_reduce_in_fp32 (default: the model's grad_dtype, fp32)")


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value}")
    return value


def default_hardware(device: str) -> str:
    """cpu on the CPU; on CUDA the preset matching nvidia-smi's device name, else h100-sxm."""
    if device == "cpu":
        return "cpu"
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        name = ""
    preset = hardware_for_device_name(name)
    if preset is None:
        stderr.print(f"no hardware preset for {name or 'this GPU'!r}: assuming h100-sxm (use --hardware)")
        return "h100-sxm"
    return preset.name


