"""Data parallel on FSDP2.

zero=0: plain data parallel through FSDP2's replicate form (`replicate_with_fsdp`):
every rank holds the full parameters, gradients and optimizer state, and gradients
are all-reduced once per optimizer step. Unlike classic DDP it composes with DTensor
tensor parallel.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from autotune.runtime.mesh import Meshes

from autotune.layout import Layout


def apply_data_parallel(model: nn.Module, mesh: Meshes, layout: Layout) -> None:
    """Wrap each block, then the root, so gradients reduce block by block during backward."""
    dp_mesh = mesh["dp_cp"]
    if dp_mesh.size() == 1:
        return
    for block in model.layers.values():
        replicate(block, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
