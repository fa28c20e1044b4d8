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

from autotune.config.model_size import GATED_MLPS


class GatedActivation(torch.autograd.Function):
    """act(gate) * up keeping only gate and up for backward, as Megatron-LM's fused
    SwiGLU does: autograd would also keep act(gate), a third tensor of the MLP's width
    per token (4 per width with down's input, 3 here). act(gate) is recomputed in
    backward; the gradients are the ops autograd runs, bit for bit."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kind = kind
        return _gate_activation(kind, gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Two tensors of the MLP's width beside the incoming gradient, as Megatron-LM's
        # fused SwiGLU backward (its output is both gradients): the gate's gradient is
        # written over the activation's, and up's over act(gate). Out of place, as
        # autograd's own backward, three lived at once. The same ops: the same bits.
        gate, up = ctx.saved_tensors
        grad_gate = grad * up  # the activation's gradient, then the gate's in its place
        if ctx.kind == "swiglu":
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        else:
            torch.ops.aten.gelu_backward.grad_input(grad_gate, gate, approximate="tanh", grad_input=grad_gate)
        grad_up = _gate_activation(ctx.kind, gate).mul_(grad)
        return grad_gate, grad_up, None


def _gate_activation(kind: str, gate: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) if kind == "swiglu" else F.gelu(gate, approximate="tanh")


def activation(kind: str, up: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's elementwise middle: of (gate, up) for the gated kinds, of up for the others."""
    if kind in ("swiglu", "geglu"):
        return GatedActivation.apply(gate, up, kind)
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
