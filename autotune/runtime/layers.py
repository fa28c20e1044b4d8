"""The parts both attention kinds share (runtime/model.py's GQA, runtime/mla.py's MLA):
RMSNorm, RoPE and the attention core."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from autotune_kernels.attention import window_mask
from autotune_kernels.norm import rms_norm


class RMSNorm(nn.Module):
    """torch's fused RMSNorm (autotune_kernels.norm: computed in fp32, keeping the input and
    one fp32 root per token for backward). Under sequence parallel the input is a DTensor
    of this rank's tokens: each rank normalises its own, and the replicated weight's
    gradient is a partial sum over the ranks (reduced where the gradients are)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor) and not isinstance(x, DTensor):
            # QK-norm under tensor parallel: x is this rank's heads, the weight replicated
            # over tp; each rank's gradient covers its own heads, a partial sum.
            return rms_norm(x, self.weight.to_local(grad_placements=[Partial()]), self.eps)
        if isinstance(x, DTensor):
            weight = self.weight.to_local(grad_placements=[Partial()]) if isinstance(self.weight, DTensor) \
                else self.weight
            return DTensor.from_local(rms_norm(x.to_local(), weight, self.eps), x.device_mesh, x.placements,
                                      run_check=False)
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin of the rotary angles position * theta^(-2i/head_dim), shape [seq, head_dim/2].

    Computed from explicit positions (not a cached table) so that context parallel can
    pass the head-tail shuffled positions of its tokens.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] by the angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(x)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask; q, k, v are [batch, seq, heads, head_dim].

    GQA: k and v have fewer heads than q; SDPA's enable_gqa shares them without copying.
    A sliding window of W tokens: query i sees keys i-W < j <= i, as a bool band mask
    (SDPA runs its fused kernel with it on the CPU; context parallel's ring skips the
    blocks outside the window instead: kernels/attention.py).
    """

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq = q.shape[1]
        mask = window_mask(seq, seq, 0, self.window, q.device) if self.window is not None and self.window < seq \
            else None
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)
