"""The hybrid vocabulary (config/hybrid.py): `hybrid_pattern` and `mamba:` checked one rule a line,
NemotronH config.json files read in both key styles, the other hybrids refused by name."""

import json
import re
from pathlib import Path

import pytest

from autotune.config import load_model, model_from_dict
from autotune.errors import UsageError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TINY = {"name": "tiny-hybrid", "vocab_size": 64, "hidden_size": 32, "num_layers": 5, "num_heads": 4,
        "num_kv_heads": 2, "ffn_hidden_size": 48, "seq_len": 16, "global_batch_size": 4, "mlp": "relu2",
        "hybrid_pattern": "M-M*E",
        "mamba": {"state_size": 8, "num_heads": 4, "head_dim": 8, "n_groups": 2, "conv_kernel": 4, "chunk_size": 4},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 16, "num_shared_experts": 1}}


def test_a_tiny_hybrid_counts_each_block_once():
    m = model_from_dict(TINY)
    h, inner, conv = 32, 32, 32 + 2 * 2 * 8
    mamba = h * (2 * inner + 2 * 2 * 8 + 4) + inner * h + conv * 5 + 3 * 4 + inner
    attention = 2 * h * 4 * 8 + 2 * h * 2 * 8
    mlp = 2 * h * 48
    moe = h * 4 + 5 * 2 * h * 16
    blocks = 2 * mamba + mlp + attention + moe + 5 * h
    assert m.num_params() == 2 * 64 * h + blocks + h
    assert m.num_active_params() == m.num_params() - 2 * 2 * h * 16
    assert [m.is_moe_layer(i) for i in range(5)] == [False, False, False, False, True]


@pytest.mark.parametrize("edit, message", [
    ({"hybrid_pattern": "M-X"}, "hybrid_pattern: one character per block from M (Mamba-2)"),
    ({"num_layers": 4}, "num_layers: must equal the length of hybrid_pattern (5), got 4"),
    ({"mamba": None}, "mamba: required with M blocks in hybrid_pattern"),
    ({"moe": None}, "moe: required with E blocks in hybrid_pattern"),
    ({"hybrid_pattern": "M-M*-"}, "moe: with hybrid_pattern only where it has E blocks"),
    ({"hybrid_pattern": None}, "mamba: only with hybrid_pattern"),
    ({"mamba": {**TINY["mamba"], "n_groups": 3}}, "mamba.n_groups: must divide mamba.num_heads (4), got 3"),
    ({"mamba": {**TINY["mamba"], "state_size": 0}}, "mamba.state_size: must be a positive integer, got 0"),
    ({"mamba": {**TINY["mamba"], "d_state": 8}}, "mamba.d_state: unknown field"),
    ({"moe": {**TINY["moe"], "layers": [4]}}, "moe.layers: not with hybrid_pattern"),
    ({"norm": "layernorm"}, "hybrid_pattern: its blocks have RMSNorm, no biases"),
])
def test_each_hybrid_rule_is_one_line(edit, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        model_from_dict({k: v for k, v in {**TINY, **edit}.items() if v is not None})


def test_the_mamba_width_is_heads_times_head_dim_not_expand():
    """NVIDIA-Nemotron-Nano-9B-v2 has 128 heads of 80 (10240 wide) beside expand 2 * 4480 = 8960."""
    nano = load_model(str(FIXTURES / "nvidia-nemotron-nano-9b-v2.json"))
    assert (nano.mamba.inner, nano.mamba.expand * nano.hidden_size) == (10240, 8960)
    assert model_from_dict({**TINY, "mamba": {**TINY["mamba"], "expand": 7}}).num_params() == \
        model_from_dict(TINY).num_params()


def test_both_key_styles_load_the_same_model():
    old, new = (load_model(str(FIXTURES / f)) for f in ("nemotron-3-nano-30b-a3b.json",
                                                        "nemotron-3-nano-30b-a3b.transformers5.json"))
    assert old.hybrid_pattern == new.hybrid_pattern == "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    assert (old.moe, old.mamba, old.num_kv_heads) == (new.moe, new.mamba, new.num_kv_heads)
    assert (new.moe.num_experts, new.moe.top_k, new.moe.num_shared_experts, new.mamba.dt_min) == (128, 6, 2, 0.001)
    h8 = load_model(str(FIXTURES / "nemotron-h-8b.json"))
    assert (h8.head_dim, h8.mlp, h8.tie_embeddings, h8.mamba.n_groups) == (128, "relu2", False, 8)


@pytest.mark.parametrize("model_type, what", [("qwen3_next", "gated DeltaNet"), ("jamba", "Jamba"),
                                              ("falcon_h1", "Falcon-H1")])
def test_other_hybrids_are_refused_by_name(tmp_path, model_type, what):
    hub = json.loads((FIXTURES / "nemotron-h-8b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**hub, "model_type": model_type}))
    with pytest.raises(UsageError, match=f"architecture {model_type} is not supported .*{what}"):
        load_model(str(path))


@pytest.mark.parametrize("edit, message", [
    ({"moe_latent_size": 1024}, "moe_latent_size (latent expert projections) is not supported"),
    ({"use_bias": True}, "use_bias true is not supported for nemotron_h"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported for nemotron_h"),
    ({"num_nextn_predict_layers": 2}, "multi-token prediction"),
    ({"hybrid_override_pattern": None}, "needs hybrid_override_pattern or layers_block_type"),
])
def test_what_nemotron_h_cannot_load_exactly_is_refused(tmp_path, edit, message):
    hub = json.loads((FIXTURES / "nemotron-h-8b.json").read_text())
    hub.update(edit)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in hub.items() if v is not None}))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_model(str(path))
