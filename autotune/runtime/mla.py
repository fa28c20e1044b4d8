"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values from a shared
low-rank latent.

    query   q = up_q(norm(down_q(x)))          (or q = wq(x) without q_lora_rank)
            each head: qk_nope_head_dim plain + qk_rope_head_dim rotated
    latent  c, k_rope = down_kv(x)             kv_lora_rank wide, and one RoPE key for all heads
    keys    k = [up_kv(norm(c))_nope, rope(k_rope)]   values v = up_kv(norm(c))_v
    out     wo(attention(q, k, v))             values v_head_dim wide per head

The attention core is the model's (SDPA, or the ring under context parallel), which
needs values as wide as queries and keys: v is zero-padded to the query head width and
the padding cut off the output (exact: zero columns of v give zero columns of out; the
softmax scale stays 1/sqrt(query head width)). torchtitan's DeepSeek-V3 pads the same way.

Tensor parallel splits the heads: up_q (or wq) and up_kv are column-parallel, wo
row-parallel, as for GQA. The down projections and the latents' norms are small and
run whole on every tp rank, as plain (not distributed) modules like the MoE blocks'
(Megatron-LM's MLA also replicates them). The column-parallel up projections
all-reduce their input gradients, so every rank's latent gradient is already the whole
one, at the latent's width rather than the hidden size. The shared RoPE key is the
exception: each rank broadcasts it to its own heads only, so its gradient is a partial
sum over tp, all-reduced by `_sum_gradient_over_tp` (rope wide: 64 numbers a token for
DeepSeek-V3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from autotune.config import ModelConfig
from autotune.runtime.layers import CoreAttention, RMSNorm, apply_rope, rope_cos_sin


def _sum_gradient_over_tp(x: torch.Tensor, tp_mesh: DeviceMesh | None) -> torch.Tensor:
    """x unchanged forward; backward all-reduces its gradient over tp (Megatron's
    copy-to-tensor-parallel-region): the local gradient is declared a partial sum."""
    if tp_mesh is None:
        return x
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        m = cfg.mla
        self.nope, self.rope, self.value = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.latent = m.kv_lora_rank
        qk = self.nope + self.rope
        if m.q_lora_rank is None:
            self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * qk, bias=False)
            self.wq_a = self.q_latent_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=False)
            self.q_latent_norm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(m.q_lora_rank, cfg.num_heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_latent_norm = RMSNorm(m.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, bias=False)
        self.core = CoreAttention(window)
        self.rope_theta = cfg.rope_theta
        self.positions: torch.Tensor | None = None  # as Attention's: context parallel sets them
        self.tp_mesh: DeviceMesh | None = None  # tensor parallel sets it (parallel/tp.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        positions = self.positions if self.positions is not None else torch.arange(seq, device=x.device)
        cos, sin = rope_cos_sin(positions, self.rope, self.rope_theta)
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_latent_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(batch, seq, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.latent, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_latent_norm(latent)).view(batch, seq, -1, self.nope + self.value)
        k_nope, v = kv.split([self.nope, self.value], dim=-1)
        heads = k_nope.shape[2]  # this rank's heads under tensor parallel
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k_rope = _sum_gradient_over_tp(apply_rope(k_rope.unsqueeze(2), cos, sin), self.tp_mesh)
        k_rope = k_rope.expand(-1, -1, heads, -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = self.core(q, k, F.pad(v, (0, self.nope + self.rope - self.value)))[..., :self.value]
        return self.wo(out.reshape(batch, seq, -1))
