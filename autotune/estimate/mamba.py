"""What a hybrid model's blocks (runtime/hybrid.py) cost the estimator: the tensors each kind
of block saves for backward, the parameters a pipeline rank holds, its per-block work.
memory.py and step_time.py call these where a model has a `hybrid_pattern` (this module knows
nothing of their accounting: it gives the items and the sizes, they add them up).

A Mamba-2 block (runtime/mamba.py), per token, with inner width I = heads * head_dim,
G groups of state N (B and C: G*N each), H heads, K taps, in the compute dtype c unless
fp32 is said:

    the causal convolution   its input (I + 2 G*N) and its output, which the SiLU after it
                             saves: (I + 2 G*N) * (seq + K - 1) / seq (the padded taps)
    the scan's inputs        x, B, C after the SiLU (I + 2 G*N); the scan keeps nothing else
                             (SSDScan: its backward runs the chunks again)
    dt (fp32)                softplus's input, the clamp's input and dt itself: 3 H
    the gated norm (fp32)    the scan's output y, z's fp32 view, silu(z), the gated product,
                             one root per group, the normalised product: 5 I + G
    out_proj's input         I

Everything of the mixer splits by tp (heads and groups), the block's norm as a dense
block's norms do (by tp under SP). Attention, MLP and MoE blocks save what the plain
model's halves save (memory.py), behind one norm each.
"""

from __future__ import annotations

from collections import Counter

from autotune.config import ModelConfig, model_size
from autotune.config.hybrid import block_kind, mamba_scan_flops_per_token
from autotune.plan.layout import Layout
from autotune.plan.stage_split import rank_stage_ids, stage_count, stage_layers

KINDS = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def mamba_saved_items(model: ModelConfig, compute: int) -> list[tuple[str, float, int, str]]:
    """The Mamba-2 mixer's saved tensors (module docstring) as (name, elements per token, bytes
    each, how tensor parallel splits them), memory.Saved's fields."""
    m = model.mamba
    conv = m.inner + 2 * m.n_groups * m.state_size
    padded = (model.seq_len + m.conv_kernel - 1) / model.seq_len
    return [("conv input", conv, compute, "tp"),
            ("conv output (silu's input)", conv * padded, compute, "tp"),
            ("scan inputs x, B, C", conv, compute, "tp"),
            ("dt: softplus input, clamp input, dt (fp32)", 3 * m.num_heads, 4, "tp"),
            ("gated norm (fp32)", 5 * m.inner + m.n_groups, 4, "tp"),
            ("out_proj input", m.inner, compute, "tp")]


def attention_widths(model: ModelConfig) -> tuple[int, int, int]:
    """Widths of q, k and v of an attention block (hybrid models: GQA)."""
    return (model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim,
            model.num_kv_heads * model.head_dim)


def op_kept_items(model: ModelConfig, kind: str, compute: int) -> list[tuple[str, float, int, str]]:
    """Per-op recompute of a Mamba, attention or MLP block, approximately: its input, and the
    outputs of every second matmul in forward order (Mamba: in_z, in_B, in_dt; attention: wq,
    wv and the core's output; MLP: up). An MoE block keeps its experts whole (memory.py)."""
    items = [("block input", model.hidden_size, compute, "sp")]
    if kind == "mamba":
        m = model.mamba
        items.append(("in_z, in_B, in_dt outputs", m.inner + m.n_groups * m.state_size + m.num_heads, compute, "tp"))
    elif kind == "attention":
        q, _, v = attention_widths(model)
        items.append(("wq, wv outputs and the core's", q + v + q, compute, "tp"))
    else:
        items.append(("up output", model.ffn_hidden_size, compute, "tp"))
    return items


def rank_kinds(model: ModelConfig, layout: Layout, rank: int) -> Counter:
    """How many blocks of each kind a pipeline rank holds."""
    spans = stage_layers(model, stage_count(layout))
    return Counter(block_kind(model, i) for s in rank_stage_ids(layout, rank) for i in spans[s])


def last_kind(model: ModelConfig, layout: Layout, rank: int) -> str:
    """The kind of a rank's last block: the first its backward runs, every activation still held."""
    spans = stage_layers(model, stage_count(layout))
    return block_kind(model, max(i for s in rank_stage_ids(layout, rank) for i in spans[s]))


def block_params(model: ModelConfig, kind: str, layout: Layout) -> tuple[float, float]:
    """(parameters a tp rank holds that FSDP shards with the dense ones, routed experts of an ep
    rank) of one block with its norm: tensor parallel splits the Mamba mixer, attention and the
    dense MLP; an MoE block stays whole on every tp rank, its routed experts split by ep."""
    norm = model_size.norm_params(model, model.hidden_size)
    if kind != "moe":
        index = model.hybrid_pattern.index(KINDS[kind])
        return norm + model_size.hybrid_block_params(model, index) / layout.tp, 0.0
    moe = model.moe
    dense = model_size.moe_router_params(model) + moe.num_shared_experts * model.expert_params()
    return norm + dense, moe.num_experts * model.expert_params() / layout.ep


def rank_params(model: ModelConfig, layout: Layout, rank: int) -> tuple[float, float, float]:
    """(dense parameters, routed expert parameters, the largest block's) of a rank's blocks."""
    dense = experts = largest = 0.0
    for kind, count in rank_kinds(model, layout, rank).items():
        d, e = block_params(model, kind, layout)
        dense, experts, largest = dense + count * d, experts + count * e, max(largest, d + e)
    return dense, experts, largest


# -- the backward of one block ----------------------------------------------------------------------

def scan_backward_elements(model: ModelConfig, tp: int) -> float:
    """Elements per token the scan's backward (SSDScan) holds at its height on a tp rank, in fp32:
    the chunked forward's graph, run again, and its gradients. Read off torch's allocator on the
    CPU for heads > 1 (tests/test_hybrid_memory.py holds the whole rank's peak to it):

        7 H*P + 6 H*N + 4 H*Q + 5 H  (per token, padded to whole chunks)  +  2 H*N*P per chunk
    """
    m = model.mamba
    heads, q = m.num_heads / tp, min(m.chunk_size, model.seq_len)
    chunks = -(-model.seq_len // q)
    padded = chunks * q / model.seq_len
    return padded * heads * (7 * m.head_dim + 6 * m.state_size + 4 * q + 5) \
        + 2 * chunks * heads * m.state_size * m.head_dim / model.seq_len


def block_backward_bytes(model: ModelConfig, kind: str, layout: Layout, compute: int, tokens: float) -> float:
    """What one block's backward adds at its height to what the rank holds: the gradient coming
    in and the block's own gradients and working tensors."""
    tp, h, c = layout.tp, model.hidden_size, compute
    incoming = tokens * h / (tp if layout.sp else 1) * c
    if kind == "mamba":
        m = model.mamba
        inner = m.inner / tp
        # z's gradient waits for in_z while the scan runs back with y's (fp32) coming in; by then
        # the gated norm's saved tensors and out_proj's input are freed.
        freed = tokens * ((5 * m.inner + m.n_groups) * 4 + m.inner * c) / tp
        return incoming + tokens * inner * (c + 4) + 4 * tokens * scan_backward_elements(model, tp) - freed
    if kind == "attention":
        q, k, v = attention_widths(model)
        return incoming + tokens * (2 * q + k + v) / tp * c + h * q / tp * c
    if kind == "mlp":
        width = model.ffn_hidden_size / tp
        return incoming + max(h * width * c + tokens * width * c, 2 * tokens * width * c)
    moe = model.moe
    rows, width = tokens * moe.top_k, moe.expert_ffn_hidden_size
    return incoming + rows * width * c + moe.num_experts / layout.ep * h * width * c


# -- the work of one block ----------------------------------------------------------------------

def block_matmul_params(model: ModelConfig, kind: str) -> float:
    """Matmul weights one token passes through in a block of `kind` (top-k experts and the shared)."""
    return model_size.hybrid_block_params(model, model.hybrid_pattern.index(KINDS[kind]), True, matmul_only=True)


def block_core_flops(model: ModelConfig, kind: str) -> float:
    """Forward + backward FLOPs per token of a block's non-matmul core: the attention scores and
    values of a `*` block, the SSD scan of an `M` block (model_size's accounting), none else."""
    if kind == "attention":
        attention_blocks = model.hybrid_pattern.count("*")
        return model_size.attention_flops_per_token(model) / attention_blocks
    if kind == "mamba":
        return mamba_scan_flops_per_token(model)
    return 0.0
