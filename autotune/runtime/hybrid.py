"""The blocks of a hybrid Mamba-2 / Transformer model (config/hybrid.py): one mixer each,
chosen by the block's letter in `hybrid_pattern`, behind one RMSNorm and a residual add:

    x + mixer(norm(x))      mixer: Mamba-2 (M), attention without RoPE (*), MLP (-), MoE (E)

A block keeps its mixer under the plain model's name for that kind (`mamba`, `attention`,
`mlp`) and None under the other two, so the parallel dimensions that find attention and MoE
blocks by those names (context parallel's ring, expert parallel, recompute) find them here
as well; `mixer_name` says which one forward runs.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune.config import ModelConfig
from autotune.config.hybrid import block_kind
from autotune.runtime.layers import RMSNorm
from autotune.runtime.mamba import Mamba2Mixer
from autotune.runtime.mlp import FeedForward
from autotune.runtime.moe import MoE


class HybridBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, attention: type[nn.Module]):
        super().__init__()
        kind = block_kind(cfg, layer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mamba = Mamba2Mixer(cfg) if kind == "mamba" else None
        self.attention = attention(cfg, cfg.window(layer)) if kind == "attention" else None
        if kind == "moe":
            self.mlp = MoE(cfg)
        else:
            self.mlp = FeedForward(cfg.hidden_size, cfg.ffn_hidden_size, cfg.mlp) if kind == "mlp" else None
        self.mixer_name = {"mamba": "mamba", "attention": "attention", "mlp": "mlp", "moe": "mlp"}[kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + getattr(self, self.mixer_name)(self.norm(x))
