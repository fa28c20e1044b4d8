"""Layout-invariant deterministic initialisation.

The correctness oracle of the whole project is that every layout trains the same
model on the same data: same seed, same full weights, whatever the degrees. So each
parameter is drawn in full from a generator keyed by (seed, its name) and then cut
into this rank's shard with the parameter's own DTensor placements. Names are the
plain model's names: wrappers that parallelism adds (activation checkpointing,
torch.compile) are stripped first.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def init_std(name: str, hidden_size: int, num_layers: int) -> float | None:
    """Standard deviation of a parameter's normal init; None for norm weights (ones).

    0.02 everywhere (GPT-2), the residual output projections (attention's wo, Mamba's out_proj, the MLP's,
    the shared experts' and the routed experts' down) scaled by 1/sqrt(2*layers) so the
    residual stream does not grow with depth, the output head by 1/sqrt(hidden).
    """
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", ".down.weight", ".experts.down", "mamba.out_proj.weight")):
        return 0.02 / math.sqrt(2 * num_layers)
    if name == "output.weight":
        return hidden_size ** -0.5
    return 0.02


@torch.no_grad()
def full_parameter(name: str, shape: torch.Size, seed: int, device: torch.device,
                   hidden_size: int, num_layers: int) -> torch.Tensor:
    std = init_std(name, hidden_size, num_layers)
    if std is None:
        return torch.ones(shape, device=device)
    generator = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, hidden_size: int, num_layers: int) -> None:
    """Fill every parameter (full or DTensor shard) with its layout-independent values."""
    for name, param in model.named_parameters():
        name = plain_name(name)
        device = param.device
        full = full_parameter(name, param.shape, seed, device, hidden_size, num_layers)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so each takes its
            # own chunk locally with no communication.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local().to(param.dtype))
        else:
            param.copy_(full.to(param.dtype))
