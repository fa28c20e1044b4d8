"""Megatron-LM's hybrid model flags for a hybrid Mamba-2 / Transformer model (config/hybrid.py).

Megatron-LM main names the block pattern `--hybrid-layer-pattern` (its older name,
`--hybrid-override-pattern`, is deprecated there and may not be given beside it) in the same
letters as ours, and derives the layer count from it; the Mamba-2 sizes are
`--mamba-state-dim`, `--mamba-head-dim`, `--mamba-num-groups` and `--mamba-num-heads` (with
the head count given, its inner width is heads * head_dim, as ours). Its Mamba mixer asserts
that tensor parallel divides the heads and the groups, as our layout rules do. The model
trains with Megatron-LM's hybrid entry point (pretrain_mamba.py, the hybrid stack spec).

Pipeline parallel is not written: Megatron-LM cuts a hybrid pattern into stages by its own
markers, which the export does not translate yet.
"""

from __future__ import annotations

from autotune.export import Target


def hybrid_flags(t: Target, add) -> str | None:
    """Add the hybrid flags through `add` (megatron.py's); the reason when the layout cannot be written."""
    m = t.model
    if t.layout.pp > 1:
        return ("pipeline parallel of a hybrid pattern is not written: Megatron-LM cuts it into stages by its "
                "own markers (use pp=1, or split the pattern by hand)")
    add(f"hybrid_pattern={m.hybrid_pattern}", "exact", ["--hybrid-layer-pattern", m.hybrid_pattern],
        "Megatron-LM main's name (--hybrid-override-pattern is deprecated); train with its hybrid entry point, "
        "pretrain_mamba.py")
    if m.mamba is not None:
        s = m.mamba
        add(f"mamba: state {s.state_size}, {s.num_heads} heads of {s.head_dim}, {s.n_groups} groups", "exact",
            ["--mamba-state-dim", str(s.state_size), "--mamba-head-dim", str(s.head_dim),
             "--mamba-num-groups", str(s.n_groups), "--mamba-num-heads", str(s.num_heads)],
            "the inner width is heads * head_dim in both")
    return None
