"""The Mamba-2 mixer in plain torch: projections, causal depthwise convolution, the chunked
state-space-duality (SSD) scan and the gated RMSNorm (config/hybrid.py gives the sizes).

Per head h (of H, head_dim P) in group g (B and C are shared by the H/G heads of a group),
with a_t = dt_t * A_h (A_h = -exp(A_log_h) < 0) the log decay of step t:

    state_t = exp(a_t) * state_{t-1} + dt_t * x_t B_t^T        (P x N)
    y_t     = state_t C_t + D_h * x_t

`ssd_scan` computes exactly that without a loop over tokens: the sequence is cut into
chunks of Q tokens; inside a chunk the recurrence unrolls into a masked, attention-like
product (C_t . B_s weighted by the decay from s to t), and only the states at chunk
boundaries are carried from chunk to chunk. `naive_scan` is the token-by-token recurrence,
kept as the reference the tests hold the chunked form to.

The projections are five linears (z, x, B, C, dt) rather than one fused in_proj, and the
convolution three weights (x, B, C), so that tensor parallel can cut each of them by heads
and groups with plain column-parallel plans, as Megatron splits its fused in_proj: rank r
owns heads [r*H/tp, ...) and groups [r*G/tp, ...), which are exactly the groups its heads
read (tensor parallel: runtime/parallel/tp_hybrid.py). Every per-head or per-channel weight
(the convolution, A_log, D, dt_bias, the gated norm's) is then this rank's shard, used as a
local tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from autotune.config import ModelConfig


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel weight, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution of x [batch, seq, channels] with weight [channels, K]:
    out_t = bias + sum_k weight[:, k] * x_{t - K + 1 + k} (zeros before the sequence)."""
    taps = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=taps - 1, groups=weight.shape[0])
    return out[..., : x.shape[1]].transpose(1, 2)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """RMSNorm of y * silu(z) within each of `groups` equal slices of the last dim, then the
    weight (Mamba-2's norm after the gate), in fp32."""
    gated = y.float() * F.silu(z.float())
    sliced = gated.unflatten(-1, (groups, -1))
    normed = sliced * torch.rsqrt(sliced.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.flatten(-2) * weight.float()).type_as(y)


class GatedRMSNorm(nn.Module):
    """gated_rms_norm's weight as a module (`norm.weight`, initialised to ones like every norm)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width))

    def forward(self, y: torch.Tensor, z: torch.Tensor, groups: int) -> torch.Tensor:
        return gated_rms_norm(y, z, local(self.weight), groups, self.eps)


def _heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, seq, groups, N] -> [batch, seq, heads, N]: each group's row for each of its heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def naive_scan(x, dt, A, B, C, D):
    """The recurrence token by token (the reference). x [b, l, H, P], dt [b, l, H], A [H],
    B, C [b, l, G, N], D [H] -> y [b, l, H, P], in fp32 (or wider, for the tests)."""
    heads, wide = x.shape[2], _scan_dtype(x)
    x, dt, A, D = (t.to(wide) for t in (x, dt, A, D))
    B, C = _heads_of_groups(B, heads).to(wide), _heads_of_groups(C, heads).to(wide)
    state = x.new_zeros(x.shape[0], heads, x.shape[3], B.shape[-1])
    out = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(out, dim=1)


def _scan_dtype(x: torch.Tensor) -> torch.dtype:
    """The scan runs in fp32 whatever the activations' precision (bf16 decays drift over a sequence)."""
    return torch.promote_types(x.dtype, torch.float32)


def _lower_triangle(size: int, device) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


def ssd_scan(x, dt, A, B, C, D, chunk: int):
    """The same recurrence, chunk by chunk (module docstring); shapes as naive_scan's.

    Laid out [batch, head, chunk, position, ...] with every matmul on contiguous operands, so
    that what its autograd graph holds is known (estimate/mamba.py prices it): per token the
    heads' x*dt, B and C (three of them, P and N wide), the chunk's scores, decays and their
    product (chunk_size wide each), B times its decay, and per chunk each head's state."""
    batch, seq, heads, head_dim = x.shape
    pad, wide = -seq % chunk, _scan_dtype(x)
    x, dt, A, D = (t.to(wide) for t in (x, dt, A, D))
    chunks = (seq + pad) // chunk

    def by_head(t: torch.Tensor) -> torch.Tensor:  # [b, l, h, w] -> [b, h, c, Q, w]
        t = F.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t
        return t.permute(0, 2, 1, 3).reshape(batch, heads, chunks, chunk, t.shape[-1])

    xdt = by_head(x * dt[..., None])
    B, C = by_head(_heads_of_groups(B, heads).to(wide)), by_head(_heads_of_groups(C, heads).to(wide))
    log_decay = F.pad(dt * A, (0, 0, 0, pad)) if pad else dt * A
    cum = log_decay.transpose(1, 2).reshape(batch, heads, chunks, chunk).cumsum(dim=-1)
    # Inside a chunk: y_q = sum_{s <= q} exp(cum_q - cum_s) (C_q . B_s) xdt_s.
    within = cum[..., :, None] - cum[..., None, :]
    causal = _lower_triangle(chunk, x.device)
    weights = torch.exp(within.masked_fill(~causal, float("-inf")))
    y = ((C @ B.transpose(-1, -2)) * weights) @ xdt
    # Each chunk's own contribution to the state at its end: [b, h, c, N, P].
    to_end = torch.exp(cum[..., -1:] - cum)
    chunk_states = (B * to_end[..., None]).transpose(-1, -2) @ xdt
    # The state entering chunk c: the earlier chunks' states, decayed across the chunks between.
    totals = cum[..., -1].cumsum(dim=-1)  # [b, h, c]: decay from the start through chunk c
    entering = F.pad(totals[..., :-1], (1, 0))  # through chunk c-1
    across = entering[..., :, None] - totals[..., None, :]  # [b, h, c, z]
    earlier = _lower_triangle(chunks, x.device).tril(-1)
    carried = (torch.exp(across.masked_fill(~earlier, float("-inf"))) @ chunk_states.flatten(-2)) \
        .view_as(chunk_states)
    y = y + (C @ carried) * torch.exp(cum)[..., None]
    y = y.reshape(batch, heads, chunks * chunk, head_dim)[:, :, :seq].transpose(1, 2)
    return y + D[:, None] * x


class SSDScan(torch.autograd.Function):
    """ssd_scan keeping only its inputs for backward, which runs the chunked forward again
    and differentiates it, as Mamba's fused kernels keep x, dt, B and C and no intermediate:
    the chunk-local scores (chunk_size per token and head) would otherwise be the largest
    thing a Mamba block keeps. Gradients are those of ssd_scan, op for op."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, chunk: int):
        ctx.save_for_backward(x, dt, A, B, C, D)
        ctx.chunk = chunk
        with torch.no_grad():
            return ssd_scan(x, dt, A, B, C, D, chunk)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ssd_scan(*inputs, ctx.chunk)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None)


class Mamba2Mixer(nn.Module):
    """x [batch, seq, hidden] -> [batch, seq, hidden] (module docstring). Under tensor parallel
    each rank holds H/tp heads and G/tp groups; the shapes below are read from the weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m, h = cfg.mamba, cfg.hidden_size
        self.head_dim, self.state_size, self.chunk_size = m.head_dim, m.state_size, m.chunk_size
        self.heads_per_group = m.num_heads // m.n_groups
        self.dt_min = m.dt_min
        groups = m.n_groups * m.state_size
        self.in_z = nn.Linear(h, m.inner, bias=False)
        self.in_x = nn.Linear(h, m.inner, bias=False)
        self.in_B = nn.Linear(h, groups, bias=False)
        self.in_C = nn.Linear(h, groups, bias=False)
        self.in_dt = nn.Linear(h, m.num_heads, bias=False)
        self.conv_x = nn.Parameter(torch.empty(m.inner, m.conv_kernel))
        self.conv_x_bias = nn.Parameter(torch.empty(m.inner))
        self.conv_B = nn.Parameter(torch.empty(groups, m.conv_kernel))
        self.conv_B_bias = nn.Parameter(torch.empty(groups))
        self.conv_C = nn.Parameter(torch.empty(groups, m.conv_kernel))
        self.conv_C_bias = nn.Parameter(torch.empty(groups))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GatedRMSNorm(m.inner, cfg.norm_eps)
        self.out_proj = nn.Linear(m.inner, h, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z, x, B, C, dt = (local(proj(hidden)) for proj in (self.in_z, self.in_x, self.in_B, self.in_C, self.in_dt))
        batch, seq, _ = x.shape
        x = F.silu(causal_conv1d(x, local(self.conv_x), local(self.conv_x_bias)))
        B = F.silu(causal_conv1d(B, local(self.conv_B), local(self.conv_B_bias)))
        C = F.silu(causal_conv1d(C, local(self.conv_C), local(self.conv_C_bias)))
        dt = F.softplus(dt.float() + local(self.dt_bias).float()).clamp(min=self.dt_min)
        A = -torch.exp(local(self.A_log).float())
        y = SSDScan.apply(x.unflatten(-1, (-1, self.head_dim)), dt, A, B.unflatten(-1, (-1, self.state_size)),
                          C.unflatten(-1, (-1, self.state_size)), local(self.D), self.chunk_size)
        groups = y.shape[2] // self.heads_per_group
        y = self.norm(y.flatten(2).to(z.dtype), z, groups)
        return self.out_proj(y)
