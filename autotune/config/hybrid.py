"""Hybrid Mamba-2 / Transformer models (Nemotron-H): the `hybrid_pattern` and `mamba:` vocabulary,
their checks, their sizes and FLOPs, and the Hugging Face NemotronH translation.

A hybrid model is a stack of single-mixer blocks, one per character of `hybrid_pattern`
(Megatron's and Nemotron-H's letters):

    M   Mamba-2 mixer          * attention (GQA, no RoPE)    - dense MLP    E MoE

Each block is `x + mixer(norm(x))` with one RMSNorm, so a hybrid "layer" is one block,
not an attention + MLP pair: `num_layers` is the pattern's length.

The Mamba-2 mixer, with h hidden, H heads of P channels, G groups of state N, kernel K:

    in_proj   h -> [z: H*P | x: H*P | B: G*N | C: G*N | dt: H]     (one matrix, no bias)
    conv1d    causal depthwise over x, B, C (H*P + 2 G*N channels, K taps, a bias each)
    scan      selective state space (SSD), per head: A_log, D, dt_bias (H each)
    norm      RMSNorm of y * silu(z) per group (H*P weights)
    out_proj  H*P -> h

The inner width is `num_heads * head_dim`, as transformers' NemotronH and Megatron build it
when the head count is given; `expand` is carried for the record and never used for a size.
Published models break `num_heads * head_dim == expand * hidden_size` (NVIDIA-Nemotron-Nano-9B-v2:
128 * 80 = 10240 against 2 * 4480; Nemotron 3 Nano: 64 * 64 = 4096 against 2 * 2688), so
that equality is not required (docs/hybrid-models.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config.files import positive
from autotune.errors import UsageError

BLOCK_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# transformers' layers_block_type names (the legacy and the current) -> our letters.
HF_BLOCK_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                  "mlp": "-", "moe": "E"}
# Hybrids of another kind, refused by name until their mixers are built.
OTHER_HYBRIDS = {"qwen3_next": "Qwen3-Next's gated DeltaNet", "jamba": "Jamba's Mamba-1 mixer",
                 "falcon_h1": "Falcon-H1's parallel attention and Mamba-2 heads"}


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 mixer's sizes (module docstring): state N, heads H of head_dim P, groups G
    sharing B and C, the causal convolution's taps, the scan's chunk length."""

    state_size: int
    num_heads: int
    head_dim: int
    n_groups: int = 1
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 128
    # dt is softplus(dt + dt_bias) clamped from below at this (transformers' time_step_min).
    dt_min: float = 0.001

    def validate(self) -> None:
        for name in ("state_size", "num_heads", "head_dim", "n_groups", "conv_kernel", "expand", "chunk_size"):
            positive(f"mamba.{name}", getattr(self, name))
        if self.num_heads % self.n_groups:
            raise UsageError(f"mamba.n_groups: must divide mamba.num_heads ({self.num_heads}), got {self.n_groups}")
        if self.dt_min < 0:
            raise UsageError(f"mamba.dt_min: must be >= 0, got {self.dt_min}")

    @property
    def inner(self) -> int:
        """The mixer's inner width: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the causal convolution: x, B and C."""
        return self.inner + 2 * self.n_groups * self.state_size


def validate_hybrid(cfg) -> None:
    """The hybrid fields of a ModelConfig `cfg`, one rule per line."""
    pattern = cfg.hybrid_pattern
    if pattern is None:
        if cfg.mamba is not None:
            raise UsageError("mamba: only with hybrid_pattern (which blocks are Mamba-2)")
        return
    if not pattern or set(pattern) - set(BLOCK_KINDS):
        raise UsageError(f"hybrid_pattern: one character per block from M (Mamba-2), * (attention), - (MLP), "
                         f"E (MoE), got {pattern!r}")
    if cfg.num_layers != len(pattern):
        raise UsageError(f"num_layers: must equal the length of hybrid_pattern ({len(pattern)}), got {cfg.num_layers}")
    if "M" in pattern:
        if cfg.mamba is None:
            raise UsageError("mamba: required with M blocks in hybrid_pattern (state_size, num_heads, head_dim, "
                             "n_groups, conv_kernel, expand, chunk_size)")
        cfg.mamba.validate()
    if "E" in pattern and cfg.moe is None:
        raise UsageError("moe: required with E blocks in hybrid_pattern")
    if "E" not in pattern and cfg.moe is not None:
        raise UsageError("moe: with hybrid_pattern only where it has E blocks")
    if cfg.moe is not None and cfg.moe.layers != "all":
        raise UsageError("moe.layers: not with hybrid_pattern (its E blocks are the MoE layers)")
    if cfg.attention != "gqa":
        raise UsageError(f"attention: must be gqa with hybrid_pattern, got {cfg.attention}")
    if cfg.norm != "rmsnorm" or cfg.bias != "none" or cfg.learned_positions:
        raise UsageError("hybrid_pattern: its blocks have RMSNorm, no biases and no position table")


def block_kind(cfg, layer: int) -> str:
    """mamba, attention, mlp or moe: the mixer of a hybrid model's block `layer`."""
    return BLOCK_KINDS[cfg.hybrid_pattern[layer]]


def layers_of(cfg, kind: str) -> list[int]:
    return [i for i, c in enumerate(cfg.hybrid_pattern) if BLOCK_KINDS[c] == kind]


# -- sizes ---------------------------------------------------------------------------------------

def mamba_in_proj_width(m: MambaConfig) -> int:
    """in_proj's outputs: z and x (inner each), B and C (groups * state each), dt (a head each)."""
    return 2 * m.inner + 2 * m.n_groups * m.state_size + m.num_heads


def mamba_params(cfg, matmul_only: bool = False) -> int:
    """One Mamba-2 mixer: in_proj, out_proj; with matmul_only false also the convolution
    (taps and bias per channel), A_log, D, dt_bias and the gated norm's weight."""
    m, h = cfg.mamba, cfg.hidden_size
    matmuls = h * mamba_in_proj_width(m) + m.inner * h
    if matmul_only:
        return matmuls
    return matmuls + m.conv_channels * (m.conv_kernel + 1) + 3 * m.num_heads + m.inner


def mamba_scan_flops_per_token(cfg) -> float:
    """Forward + backward FLOPs of one Mamba-2 mixer's SSD scan per token (the projections are
    counted as matmul parameters), each chunk of Q tokens charged in full like attention's
    causal mask:

        3 * heads * (2 Q N  [C B^T inside the chunk]  +  2 Q P  [its scores times x]
                     + 2 P N  [the chunk's state from x and B]  +  2 P N  [C times the state in])

    The convolution (2 K FLOPs a channel) is counted too; the inter-chunk recurrence
    (chunks^2 / Q per token) and the elementwise gating are left out."""
    m = cfg.mamba
    q = min(m.chunk_size, cfg.seq_len)
    per_head = 2 * q * m.state_size + 2 * q * m.head_dim + 4 * m.head_dim * m.state_size
    return 3 * (m.num_heads * per_head + 2 * m.conv_kernel * m.conv_channels)


# -- Hugging Face NemotronH ------------------------------------------------------------------------

def hf_pattern(hf: dict, name: str) -> str:
    """The block pattern of a NemotronH config.json: `hybrid_override_pattern`, or transformers 5's
    `layers_block_type` list."""
    pattern = hf.get("hybrid_override_pattern")
    if pattern is None and hf.get("layers_block_type") is not None:
        types = hf["layers_block_type"]
        unknown = sorted({t for t in types if t not in HF_BLOCK_TYPES})
        if unknown:
            raise UsageError(f"{name}: layers_block_type: unknown block types {unknown} "
                             f"(known: {', '.join(HF_BLOCK_TYPES)})")
        pattern = "".join(HF_BLOCK_TYPES[t] for t in types)
    if not pattern:
        raise UsageError(f"{name}: nemotron_h config.json needs hybrid_override_pattern or layers_block_type")
    return pattern


def from_nemotron_h(hf: dict, name: str) -> dict:
    """Translate a NemotronHForCausalLM config.json (either key style) into our fields.

    Refused, each in one line: biases (use_bias, mlp_bias, attention_bias), a convolution
    without bias, a MoE latent projection, multi-token prediction layers, a sliding window,
    grouped expert routing, activations other than squared ReLU (MLP) and SiLU (Mamba)."""
    pattern = hf_pattern(hf, name)
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "mamba_num_heads", "mamba_head_dim",
                "ssm_state_size"):
        if hf.get(key) is None and not (key.startswith(("mamba", "ssm")) and "M" not in pattern):
            raise UsageError(f"{name}: {key}: missing from the nemotron_h config.json")
    for key in ("use_bias", "mlp_bias", "attention_bias"):
        if hf.get(key):
            raise UsageError(f"{name}: {key} true is not supported for nemotron_h")
    if hf.get("use_conv_bias") is False:
        raise UsageError(f"{name}: use_conv_bias false is not supported for nemotron_h")
    if hf.get("moe_latent_size") is not None:
        raise UsageError(f"{name}: moe_latent_size (latent expert projections) is not supported for nemotron_h")
    if hf.get("num_nextn_predict_layers"):
        raise UsageError(f"{name}: num_nextn_predict_layers (multi-token prediction) is not supported")
    if hf.get("sliding_window") is not None:
        raise UsageError(f"{name}: sliding_window is not supported for nemotron_h")
    if int(hf.get("n_group") or 1) != 1:
        raise UsageError(f"{name}: n_group {hf['n_group']} (grouped expert routing) is not supported")
    for key, allowed in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if hf.get(key, allowed) != allowed:
            raise UsageError(f"{name}: {key} {hf[key]!r} is not supported for nemotron_h (only {allowed})")
    h = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf.get("attention_head_dim") or 128  # transformers' default
    out = {
        "name": name, "vocab_size": hf["vocab_size"], "hidden_size": h, "num_layers": len(pattern),
        "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads", 8) or heads, "head_dim": head_dim,
        "ffn_hidden_size": hf.get("intermediate_size") or 21504, "mlp": "relu2",  # transformers' default width
        "norm_eps": hf.get("layer_norm_epsilon") or hf.get("rms_norm_eps") or 1e-5,
        "tie_embeddings": False,  # NemotronHForCausalLM never ties its head
        "hybrid_pattern": pattern,
    }
    if "M" in pattern:
        step = hf.get("time_step_min", hf.get("mamba_dt_min", 0.001))
        out["mamba"] = {
            "state_size": hf["ssm_state_size"], "num_heads": hf["mamba_num_heads"], "head_dim": hf["mamba_head_dim"],
            "n_groups": hf.get("n_groups") or hf.get("mamba_n_groups") or 8,
            "conv_kernel": hf.get("conv_kernel") or hf.get("mamba_d_conv") or 4,
            "expand": hf.get("expand") or hf.get("mamba_expand") or 2,
            "chunk_size": hf.get("chunk_size") or hf.get("mamba_chunk_size") or 128, "dt_min": float(step)}
    if "E" in pattern:
        out["moe"] = _nemotron_moe(hf, name)
    return out


def _nemotron_moe(hf: dict, name: str) -> dict:
    """Routed experts and the one shared expert (transformers builds it whatever n_shared_experts
    says), as whole experts of the routed width: one shared expert twice as wide is two (the same
    parameters and FLOPs, squared ReLU being elementwise)."""
    experts, width = hf.get("n_routed_experts"), hf.get("moe_intermediate_size")
    if not experts or not width:
        raise UsageError(f"{name}: E blocks need n_routed_experts and moe_intermediate_size")
    shared = int(hf.get("moe_shared_expert_intermediate_size", 7688) or 0)  # NemotronHMoE builds exactly one
    if shared % width:
        raise UsageError(f"{name}: moe_shared_expert_intermediate_size {shared} is not a multiple of "
                         f"moe_intermediate_size {width}: not supported")
    return {"num_experts": experts, "top_k": hf.get("num_experts_per_tok") or 2, "expert_ffn_hidden_size": width,
            "num_shared_experts": shared // width, "aux_loss_weight": hf.get("router_aux_loss_coef", 0.0001)}
