"""The dense MLP of a block, shared by the plain model and the MoE block's shared experts.

    swiglu  down(silu(gate(x)) * up(x))      Llama, Mistral, Qwen, DeepSeek
    geglu   down(gelu(gate(x)) * up(x))      Gemma (tanh-approximated GELU)
    gelu    down(gelu(up(x)))                GPT-2, GPT-NeoX, Phi (tanh-approximated GELU)
    relu2   down(relu(up(x))^2)              Nemotron-4

Gated kinds have a `gate` matrix beside `up`; the plain kinds have none, so tensor
parallel cuts `gate` only where it exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autotune.model_size import GATED_MLPS


def activation(kind: str, up: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's elementwise middle: of (gate, up) for the gated kinds, of up for the others."""
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "geglu":
        return F.gelu(gate, approximate="tanh") * up
    if kind == "gelu":
        return F.gelu(up, approximate="tanh")
    if kind == "relu2":
        return F.relu(up).square()
    raise ValueError(f"unknown mlp kind {kind!r}")


class FeedForward(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, kind: str = "swiglu"):
        super().__init__()
        self.kind = kind
        self.gate = nn.Linear(hidden_size, ffn_hidden_size, bias=False) if kind in GATED_MLPS else None
        self.up = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(activation(self.kind, self.up(x), self.gate(x) if self.gate is not None else None))
