"""The trained precision in torch terms: what the model computes in, how FSDP casts, fp16's
loss scaler, and torchao's 8-bit linear layers.

    dtype  computes in  parameters and gradients         linears' GEMMs
    fp32   fp32         fp32                              fp32
    bf16   bf16         fp32 masters, fp32 reduction      bf16
    fp16   fp16         as bf16, and a dynamic loss scale fp16
    fp8    bf16         as bf16                           e4m3 with per-tensor or per-row scales
    mxfp8  bf16         as bf16                           e4m3 with one e8m0 scale per 32 elements

`grad_dtype` equal to the compute dtype (Megatron-LM without grad_reduce_in_fp32, as NVIDIA's
performance recipes train) accumulates and reduces the gradients in it: zero 0/1's buffer
holds 2 bytes per parameter instead of 4 and the optimizer takes an fp32 copy of its own
slice for the step; FSDP reduce-scatters in it into fp32 shards.

fp8 and mxfp8 change only the blocks' linear layers (attention projections, dense MLPs):
torchao casts their input, weight and output gradient to 8 bits for each GEMM and keeps
the bf16 tensors for backward, so master weights, optimizer state, activations and every
collective stay as bf16 has them. The router, the experts and the output head stay bf16
(as torchtitan leaves the head: its logits feed the loss).

On a device without 8-bit tensor cores (the CPU, CUDA before compute capability 8.9)
torchao's emulation runs instead: the same casts and scales, the GEMM in high precision
on the dequantised values. A trial says so (`precision_emulated`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from autotune.config import ModelConfig

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp8": torch.bfloat16, "mxfp8": torch.bfloat16}
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearRecipeName values we train with
EIGHT_BIT = ("fp8", "mxfp8")


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype activations and the working copy of the parameters are in (the spec's model
    carries the trained precision: config.as_trained)."""
    return COMPUTE_DTYPES[cfg.dtype]


def grad_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype gradients are accumulated and reduced in (the spec's model carries it)."""
    return COMPUTE_DTYPES[cfg.grad_dtype]


def mixed_precision_policy(cfg: ModelConfig) -> MixedPrecisionPolicy | None:
    """FSDP2's compute in the working dtype with fp32 master weights, reducing in the
    gradients' dtype (fp32 unless grad_dtype says otherwise); None for fp32."""
    if cfg.dtype == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=compute_dtype(cfg), reduce_dtype=grad_dtype(cfg))


def emulated(device: torch.device) -> bool:
    """Whether 8-bit GEMMs are emulated here: no fp8 tensor cores (the CPU, CUDA < sm89)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def converted_linears(model: nn.Module) -> list[nn.Module]:
    """The modules whose linears train in 8 bits: each block's attention, and its MLP where
    it is dense (MoE blocks stay bf16; a hybrid model's Mamba blocks, which hold neither,
    stay bf16 too)."""
    from autotune.runtime.mlp import FeedForward

    out = []
    for block in model.layers.values():
        if block is None:
            continue
        if getattr(block, "attention", None) is not None:
            out.append(block.attention)
        if isinstance(getattr(block, "mlp", None), FeedForward):
            out.append(block.mlp)
    return out


def convert_to_eight_bit(model: nn.Module, cfg: ModelConfig, device: torch.device, recipe: str = "tensorwise") -> bool:
    """Swap the blocks' linears for torchao's fp8 (`recipe`: tensorwise or rowwise scales)
    or MXFP8 training linears, on the meta-device model before any parallelism touches it.
    Returns whether the 8-bit GEMMs are emulated; nothing happens for other precisions."""
    if cfg.dtype not in EIGHT_BIT:
        return False
    is_emulated = emulated(device)
    if cfg.dtype == "fp8":
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe: must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=is_emulated)
        for module in converted_linears(model):
            convert_to_float8_training(module, config=config)
    else:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        name = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if is_emulated else MXFP8TrainingRecipe.MXFP8_RCEIL
        for module in converted_linears(model):
            quantize_(module, MXFP8TrainingOpConfig.from_recipe(name),
                      filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    return is_emulated


class LossScaler:
    """fp16's dynamic loss scale: the loss is multiplied by `scale` before backward so that
    small gradients survive fp16's range; the gradients are divided by it before clipping
    and the step. A step whose gradients overflowed (inf or NaN in the global norm, the
    same on every rank) is skipped and the scale halved; after `growth_interval` good steps
    it doubles. torch.amp.GradScaler's rule, over our data parallel's gradient buffers."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale, self.growth_interval, self.good_steps = scale, growth_interval, 0
        self.skipped = 0

    def unscale_and_check(self, dp, pipeline_group=None) -> bool:
        """Divide the reduced gradients by the scale; whether the step may run."""
        dp.scale_gradients(torch.tensor(1.0 / self.scale))
        finite = bool(torch.isfinite(dp.grad_norm(pipeline_group)))
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale, self.good_steps, self.skipped = self.scale / 2.0, 0, self.skipped + 1
        return finite
