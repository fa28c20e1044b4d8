"""Parameter counts and FLOPs per token of a ModelConfig, every kind of block.

Counted as transformers counts its own models (tests/test_param_counts.py builds them on
the meta device and compares), because the estimator prices memory and time from these
numbers and a model priced 30% too large or too small picks the wrong layout.

Per layer, with h hidden, H heads, KV kv heads, d head_dim:

    gqa attention   q, o: h * H*d each; k, v: h * KV*d each
                    bias qkv: + H*d + 2 KV*d; bias all: + h more (o's bias)
                    qk_norm: + 2 d (one RMSNorm weight for every query head, one for keys)
    mla attention   q: h * H*(nope+rope), or with q_lora_rank r_q: h*r_q + r_q (norm) + r_q * H*(nope+rope)
                    down kv: h * (r_kv + rope); its norm r_kv; up kv: r_kv * H*(nope+v); o: H*v * h
    mlp (width f)   swiglu, geglu: 3 h f (gate, up, down); gelu, relu2: 2 h f (up, down)
                    bias all: + f per input matrix + h (down's bias)
    moe             router h*E (+ E with bias all) + (E routed + S shared) experts, each an mlp
                    of the model's kind and width expert_ffn_hidden_size
    norms           two per layer and a final one, h each (layernorm: a bias as well, 2 h)

    hybrid          one mixer per block (config/hybrid.py: Mamba-2's sizes) and one norm

and once: the embedding V*h, the output head V*h unless tied, a learned position table.
Active parameters count top_k of the E routed experts instead of E.

What these do not count, each under 0.01% of its models (the test's tolerance says so):
GPT-OSS's attention sinks (H per layer), Phi's output-head bias (V), Qwen2-MoE's shared
expert gate (h per MoE layer), Gemma 2/3's two extra norms per layer (2h), Phi's one
norm per layer instead of two, OLMo 1's weightless LayerNorm, OLMo 2's QK-norm over the
whole projection instead of per head.
"""

from __future__ import annotations

from autotune.config import hybrid

# Each function takes a ModelConfig `cfg` (not imported: config.py imports this module).
GATED_MLPS = ("swiglu", "geglu")


def mlp_matrices(cfg) -> int:
    """Weight matrices of one MLP: gated kinds have a gate beside the up projection."""
    return 3 if cfg.mlp in GATED_MLPS else 2


def norm_params(cfg, width: int) -> int:
    return width * (2 if cfg.norm == "layernorm" else 1)


def attention_params(cfg, matmul_only: bool = False) -> int:
    """One layer's attention; `matmul_only` leaves out biases and norm weights (FLOPs)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            q, q_norm = h * heads * qk, 0
        else:
            q, q_norm = h * m.q_lora_rank + m.q_lora_rank * heads * qk, m.q_lora_rank
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = heads * m.v_head_dim * h
        return q + kv + o + (0 if matmul_only else q_norm + m.kv_lora_rank)
    q, kv = heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    matmuls = 2 * h * q + 2 * h * kv
    if matmul_only:
        return matmuls
    bias = {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + h}[cfg.bias]
    return matmuls + bias + (2 * cfg.head_dim if cfg.qk_norm else 0)


def unsplit_attention_params(cfg) -> int:
    """Attention parameters tensor parallel leaves whole on every rank: MLA's down
    projections and latent norms (runtime/mla.py); none for GQA."""
    if cfg.attention != "mla":
        return 0
    m = cfg.mla
    q = cfg.hidden_size * m.q_lora_rank + m.q_lora_rank if m.q_lora_rank else 0
    return q + cfg.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank


def mlp_params(cfg, width: int, matmul_only: bool = False) -> int:
    """One MLP of the model's kind, `width` wide (the dense MLP, or one expert)."""
    matrices = mlp_matrices(cfg)
    params = matrices * cfg.hidden_size * width
    if cfg.bias == "all" and not matmul_only:
        params += (matrices - 1) * width + cfg.hidden_size
    return params


def moe_router_params(cfg, matmul_only: bool = False) -> int:
    experts = cfg.moe.num_experts
    return cfg.hidden_size * experts + (experts if cfg.bias == "all" and not matmul_only else 0)


def layer_mlp_params(cfg, layer: int, active_only: bool = False, matmul_only: bool = False) -> int:
    """A layer's MLP: the dense one, or router + routed experts (top_k if active_only) + shared."""
    if not cfg.is_moe_layer(layer):
        return mlp_params(cfg, cfg.ffn_hidden_size, matmul_only)
    moe = cfg.moe
    routed = moe.top_k if active_only else moe.num_experts
    expert = mlp_params(cfg, moe.expert_ffn_hidden_size, matmul_only)
    return moe_router_params(cfg, matmul_only) + (routed + moe.num_shared_experts) * expert


def hybrid_block_params(cfg, layer: int, active_only: bool = False, matmul_only: bool = False) -> int:
    """A hybrid block's mixer (config/hybrid.py), without its norm: Mamba-2, attention, MLP or MoE."""
    kind = hybrid.block_kind(cfg, layer)
    if kind == "mamba":
        return hybrid.mamba_params(cfg, matmul_only)
    if kind == "attention":
        return attention_params(cfg, matmul_only)
    return layer_mlp_params(cfg, layer, active_only, matmul_only)


def num_params(cfg, active_only: bool = False) -> int:
    """Every parameter: embeddings (and a learned position table), blocks (two norms
    each), final norm, output head (none when tied to the embedding)."""
    h = cfg.hidden_size
    if cfg.hybrid_pattern is not None:  # one norm per single-mixer block
        blocks = sum(hybrid_block_params(cfg, i, active_only) + norm_params(cfg, h) for i in range(cfg.num_layers))
    else:
        blocks = sum(attention_params(cfg) + layer_mlp_params(cfg, i, active_only) + 2 * norm_params(cfg, h)
                     for i in range(cfg.num_layers))
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_embeddings else embedding
    return embedding + cfg.learned_positions * h + blocks + norm_params(cfg, h) + head


def active_matmul_params(cfg) -> int:
    """Matmul weights one token passes through: blocks (top-k experts only) + output head.

    The embedding is a lookup, not a matmul, and norms and biases are elementwise: none
    counts. A tied head is still a matmul over the vocabulary."""
    if cfg.hybrid_pattern is not None:
        return sum(hybrid_block_params(cfg, i, True, matmul_only=True) for i in range(cfg.num_layers)) \
            + cfg.vocab_size * cfg.hidden_size
    blocks = sum(attention_params(cfg, matmul_only=True) + layer_mlp_params(cfg, i, True, matmul_only=True)
                 for i in range(cfg.num_layers))
    return blocks + cfg.vocab_size * cfg.hidden_size


def attention_head_dims(cfg) -> tuple[int, int]:
    """(query/key head width, value head width): equal for GQA, nope+rope and v for MLA."""
    if cfg.attention == "mla":
        return cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    return cfg.head_dim, cfg.head_dim


def rope_head_dim(cfg) -> int:
    """Width RoPE rotates per head: the head, MLA's shared RoPE part, none with learned positions."""
    if cfg.learned_positions or cfg.hybrid_pattern is not None:  # Nemotron-H's attention has no RoPE
        return 0
    return cfg.mla.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim


def attended_keys(cfg, layer: int) -> int:
    """Keys each query is charged for: seq_len, or the window where a layer has one (the
    causal mask is not discounted, as in PaLM's accounting; a window is charged in full)."""
    window = cfg.window(layer)
    return cfg.seq_len if window is None else min(window, cfg.seq_len)


def attention_flops_per_token(cfg) -> float:
    """Forward + backward FLOPs of the attention cores per token, summed over layers:

        6 * heads * (qk_head_dim + v_head_dim) * keys

    2 FLOPs per multiply-add for the scores (qk wide) and for the weighted sum of values
    (v wide), times 3 for forward and backward. With equal widths d this is PaLM's
    12 * heads * d * seq_len per layer."""
    qk, v = attention_head_dims(cfg)
    layers = range(cfg.num_layers) if cfg.hybrid_pattern is None else hybrid.layers_of(cfg, "attention")
    return sum(6 * cfg.num_heads * (qk + v) * attended_keys(cfg, i) for i in layers)


def flops_per_token(cfg) -> float:
    """Model FLOPs per trained token, forward + backward, recompute not counted:

        6 * active matmul params + attention_flops_per_token

    The first term is 2 FLOPs per multiply-add, times 3 for forward + backward; a hybrid
    model adds its Mamba-2 scans (hybrid.mamba_scan_flops_per_token)."""
    scans = 0.0
    if cfg.hybrid_pattern is not None and cfg.mamba is not None:
        scans = len(hybrid.layers_of(cfg, "mamba")) * hybrid.mamba_scan_flops_per_token(cfg)
    return 6 * active_matmul_params(cfg) + attention_flops_per_token(cfg) + scans
