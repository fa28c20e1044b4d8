"""A plain Llama-style decoder: RMSNorm, RoPE, GQA attention (optionally QK-normed) or
multi-head latent attention (runtime/mla.py), full causal or over a sliding window, an
MLP of the model's kind (SwiGLU, GeGLU, GELU, squared ReLU) or MoE; or, with a
`hybrid_pattern`, single-mixer blocks with Mamba-2 among them (runtime/hybrid.py).

What it does not build (biases, LayerNorm, learned positions, tied embeddings)
autotune/config/trainable.py refuses before a trial starts.

It knows nothing of parallelism. Every parallel dimension is applied from outside
(runtime/parallel/*), which is why:
- layers live in a ModuleDict keyed by their global index, so a pipeline stage can
  delete the layers it does not own and keep the others' names;
- `forward` skips the embedding, the final norm or the head when a stage has none
  (they are set to None), so one forward serves every stage;
- the attention core is its own module (`CoreAttention`), so context parallel can
  swap in ring attention and selective recompute can checkpoint just that, and
  `Attention.positions` can carry the head-tail shuffled positions of CP's tokens;
- q/k/v are viewed with -1 heads, so the same code runs the per-rank head count
  that tensor parallel leaves on each rank.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune.config import ModelConfig
from autotune.runtime.layers import CoreAttention, RMSNorm, apply_rope, rope_cos_sin
from autotune.runtime.mla import MLAttention
from autotune.runtime.mlp import FeedForward
from autotune.runtime.moe import MoE


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.core = CoreAttention(window)
        # QK-norm (Qwen3, OLMo 2, Gemma 3): RMSNorm of every query and key head before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # A hybrid model's attention has no position encoding (Nemotron-H): its Mamba blocks order the tokens.
        self.rope_theta = cfg.rope_theta if cfg.hybrid_pattern is None else None
        # Positions of this rank's tokens; None means 0..seq-1. Context parallel sets them.
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x is the whole (local) sequence here: sequence parallel gathers it before wq/wk/wv.
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            positions = self.positions if self.positions is not None else torch.arange(seq, device=x.device)
            cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.core(q, k, v).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if cfg.attention == "mla":
            self.attention = MLAttention(cfg, cfg.window(layer))
        else:
            self.attention = Attention(cfg, cfg.window(layer))
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg)
        else:
            self.mlp = FeedForward(cfg.hidden_size, cfg.ffn_hidden_size, cfg.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.hybrid_pattern is None:
            self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        else:
            from autotune.runtime.hybrid import HybridBlock  # it builds this module's Attention

            self.layers = nn.ModuleDict({str(i): HybridBlock(cfg, i, Attention) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab], or hidden states in/out
        for the pipeline stages that lack the embedding or the head."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
