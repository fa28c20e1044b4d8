"""Our parameter counts against transformers' own, for every supported architecture.

Each fixture under tests/fixtures/hf is a config.json (as published on the hub, or as
transformers 5 writes it). transformers builds the model from it on the meta device (no
weights, no download) and counts its parameters; ours must agree within 0.01%, the
largest difference being what model_size.py says it leaves out (extra norms, sinks).
Active parameters: transformers' total less the routed experts a token does not use,
read off its own expert tensors.
"""

import json
import re
from pathlib import Path

import pytest

from autotune.config import load_model
from autotune.errors import UsageError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
SUPPORTED = sorted(p.name for p in FIXTURES.glob("*.json") if p.stem not in ("bert-base-uncased", "mamba-130m"))


def transformers_counts(path: Path) -> tuple[int, int]:
    """(total, active) parameters of transformers' model for a config.json."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hub = json.loads(path.read_text())
    model_type = {"kimi_k2": "deepseek_v3"}.get(hub["model_type"], hub["model_type"])
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in hub.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None) \
        or getattr(config, "num_experts", None)
    inactive = 0
    if experts:
        top_k = config.num_experts_per_tok
        for name, p in model.named_parameters():
            if ".experts." in name or name.endswith(".experts"):
                inactive += p.numel() * (experts - top_k) // experts
    return total, total - inactive


@pytest.mark.parametrize("fixture", SUPPORTED)
def test_parameter_counts_match_transformers(fixture):
    ours = load_model(str(FIXTURES / fixture))
    total, active = transformers_counts(FIXTURES / fixture)
    assert ours.num_params() == pytest.approx(total, rel=1e-4)
    assert ours.num_active_params() == pytest.approx(active, rel=1e-4)


# The issue's table: what each config loads as (billions, total / active), or its refusal.
@pytest.mark.parametrize("fixture, total, active", [
    ("deepseek-v3.json", 671.03, 37.55), ("deepseek-v3.transformers5.json", 671.03, 37.55),
    ("kimi-k2.json", 1026.41, 32.86),
    ("qwen3-30b-a3b.json", 30.53, 3.35), ("qwen3-30b-a3b.transformers5.json", 30.53, 3.35),
    ("gpt-neox-20b.json", 20.55, 20.55), ("phi-1.json", 1.42, 1.42), ("phi-2.json", 2.78, 2.78),
    ("gpt2.json", 0.124, 0.124), ("llama-3.1-8b.transformers5.json", 8.03, 8.03),
    ("mixtral-8x7b.json", 46.70, 12.88), ("gpt-oss-20b.json", 20.91, 4.19),
    ("nemotron-h-8b.json", 8.10, 8.10), ("nemotron-h-47b.json", 46.79, 46.79), ("nemotron-h-56b.json", 56.32, 56.32),
    ("nvidia-nemotron-nano-9b-v2.json", 8.89, 8.89), ("nemotron-3-nano-30b-a3b.json", 31.58, 3.58),
    ("nemotron-3-nano-30b-a3b.transformers5.json", 31.58, 3.58),
])
def test_the_issue_table(fixture, total, active):
    m = load_model(str(FIXTURES / fixture))
    assert (m.num_params() / 1e9, m.num_active_params() / 1e9) == (pytest.approx(total, abs=0.01),
                                                                   pytest.approx(active, abs=0.01))


def test_what_each_family_loads_as():
    def load(name):
        return load_model(str(FIXTURES / name))

    ds = load("deepseek-v3.transformers5.json")
    assert (ds.attention, ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.head_dim) == ("mla", 1536, 512, 192)
    assert ds.moe.layers == list(range(3, 61)) and ds.moe.num_shared_experts == 1 and ds.moe.num_experts == 256
    assert load("llama-3.1-8b.transformers5.json").rope_theta == 500000.0
    assert load("qwen3-30b-a3b.transformers5.json").moe.expert_ffn_hidden_size == 768
    assert (load("gpt-neox-20b.json").mlp, load("phi-1.json").mlp, load("gemma-7b.json").mlp,
            load("nemotron-minitron-4b.json").mlp) == ("gelu", "gelu", "geglu", "relu2")
    gpt2 = load("gpt2.json")
    assert (gpt2.num_layers, gpt2.hidden_size, gpt2.ffn_hidden_size, gpt2.learned_positions, gpt2.tie_embeddings) \
        == (12, 768, 3072, 1024, True)
    oss = load("gpt-oss-20b.json")
    assert oss.sliding_window == 128 and oss.sliding_window_layers == list(range(0, 24, 2))
    gemma3 = load("gemma-3-1b.json")
    assert gemma3.qk_norm and [i for i in range(26) if gemma3.window(i) is None] == [5, 11, 17, 23]
    assert load("mistral-7b.json").sliding_window == 4096 and load("mistral-7b.json").sliding_window_layers is None
    assert load("qwen2-7b.json").bias == "qkv" and load("qwen2-7b.json").sliding_window is None
    assert load("qwen1.5-moe-a2.7b.json").moe.num_shared_experts == 4


@pytest.mark.parametrize("fixture, message", [
    ("bert-base-uncased.json", "architecture bert (BertForMaskedLM) is not supported"),
    ("mamba-130m.json", "architecture mamba (MambaForCausalLM) is not supported"),
])
def test_other_architectures_are_refused_by_name(fixture, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        load_model(str(FIXTURES / fixture))


@pytest.mark.parametrize("edit, message", [
    ({"model_type": None, "architectures": ["FalconForCausalLM"]}, "architecture FalconForCausalLM is not supported"),
    ({"model_type": None, "architectures": None}, "names no model_type or architectures"),
    ({"hidden_act": "tanh"}, "hidden_act 'tanh' is not supported for llama"),
    ({"attention_bias": True}, "attention_bias true with mlp_bias false is not supported"),
    ({"num_local_experts": 8}, "num_local_experts in a llama config.json: experts are not supported"),
])
def test_what_cannot_load_exactly_is_refused(tmp_path, edit, message):
    hub = json.loads((FIXTURES / "llama-3.1-8b.transformers5.json").read_text())
    hub.update(edit)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in hub.items() if v is not None}))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_model(str(path))


@pytest.mark.parametrize("preset, fixture", [("deepseek-v3", "deepseek-v3.json"),
                                             ("qwen3-235b-a22b", "qwen3-235b-a22b.json"),
                                             ("qwen3-30b-a3b", "qwen3-30b-a3b.json")])
def test_presets_are_their_published_configs(preset, fixture):
    ours, theirs = load_model(preset), load_model(str(FIXTURES / fixture))
    assert (ours.num_params(), ours.num_active_params(), ours.flops_per_token() / ours.seq_len) == \
        (theirs.num_params(), theirs.num_active_params(), theirs.flops_per_token() / theirs.seq_len)
