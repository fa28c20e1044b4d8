"""The precisions a model trains in and the spellings people write them in."""

from __future__ import annotations

from typing import Literal, get_args

from autotune.errors import UsageError

# The precisions a model trains in. fp16 trains with a loss scaler; fp8 and mxfp8 run the
# linear layers' matmuls in 8-bit floats (per-tensor or per-row scales; per-32-element
# block scales) on bf16 compute, with fp32 masters and optimizer state as bf16 has.
Dtype = Literal["bf16", "fp16", "fp32", "fp8", "mxfp8"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
# The spellings people use for them: Hugging Face's torch_dtype, torch's names, fp8 formats.
DTYPE_SPELLINGS = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp8": "fp8", "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e4m3fn": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8",
    "fp8_hybrid": "fp8",  # Transformer Engine's e4m3 forward, e5m2 gradients: torchao's recipes do the same
    "mxfp8": "mxfp8", "mx_fp8": "mxfp8", "mxfp8_e4m3": "mxfp8",
}
# What the gradients are accumulated, reduced and kept in under mixed precision: fp32 (the
# default, Megatron-LM's `grad_reduce_in_fp32`, torchtitan's `mixed_precision_reduce`), or
# the compute dtype (bf16 or fp16), as NVIDIA's Megatron-Bridge performance recipes train.
GradDtype = Literal["fp32", "bf16", "fp16"]
GRAD_DTYPES: tuple[GradDtype, ...] = get_args(GradDtype)
# Precisions people train in that this tool does not: named so that the refusal says so.
UNTRAINED_DTYPES = ("nvfp4", "mxfp4", "fp4", "mxfp6", "fp6", "int8", "int4", "fp64", "float64", "tf32")


def parse_dtype(value, field: str = "dtype") -> str:
    """The canonical name (DTYPES) of a precision as people write it (DTYPE_SPELLINGS); a
    precision this tool does not train, or no precision at all, is a usage error naming it."""
    key = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
    if key in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[key]
    if key in UNTRAINED_DTYPES:
        raise UsageError(f"{field}: {value} is a precision autotune does not train "
                         f"(it trains {', '.join(DTYPES)})")
    raise UsageError(f"{field}: must be one of {', '.join(DTYPES)} (or bfloat16, float16, float32, fp8_e4m3), "
                     f"got {value!r}")


def compute_dtype_name(dtype: str) -> str:
    """The dtype a model trained in `dtype` computes in: fp8 and mxfp8 compute in bf16."""
    return "bf16" if dtype in ("fp8", "mxfp8") else dtype


def parse_grad_dtype(value, dtype: str, field: str = "grad_dtype") -> str:
    """The gradients' precision (GRAD_DTYPES) for a model trained in `dtype`: fp32, or the
    compute dtype itself (bf16 gradients of an fp16 model, or below fp32 in an fp32 one,
    are refused: no framework trains so)."""
    allowed = sorted({"fp32", compute_dtype_name(dtype)})
    key = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
    name = DTYPE_SPELLINGS.get(key)
    if name not in allowed:
        raise UsageError(f"{field}: with dtype {dtype} must be {' or '.join(allowed)}, got {value!r}")
    return name


