import json
import re

import pytest

from autotune.config import (
    as_trained,
    hardware_for_device_name,
    load_hardware,
    load_model,
    model_presets,
    trained_dtype,
)
from autotune.errors import UsageError


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


TINY = """
name: t
vocab_size: 128
hidden_size: 32
num_layers: 2
num_heads: 4
ffn_hidden_size: 64
seq_len: 16
global_batch_size: 4
"""


def test_every_preset_loads_and_validates():
    assert {"tiny", "tiny-moe", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b",
            "qwen3-30b-a3b"} <= set(model_presets())
    for name in model_presets():
        assert load_model(name).name == name


@pytest.mark.parametrize("preset, billions", [
    ("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85), ("mixtral-8x7b", 46.70),
    ("qwen3-30b-a3b", 30.53)])
def test_parameter_counts_match_the_published_sizes(preset, billions):
    assert load_model(preset).num_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_derived_defaults(tmp_path):
    m = load_model(write(tmp_path, "t.yaml", TINY))
    assert m.num_kv_heads == 4 and m.head_dim == 8 and m.moe is None and m.dtype == "bf16"


@pytest.mark.parametrize("edit, message", [
    ("hidden_size: -4", "hidden_size: must be a positive integer, got -4"),
    ("num_layers: 0", "num_layers: must be a positive integer, got 0"),
    ("seq_len: 16.5", "seq_len: must be int, got float 16.5"),
    ("vocab_size: lots", "vocab_size: must be int, got str 'lots'"),
    ("num_kv_heads: 3", "num_kv_heads: must divide num_heads (4), got 3"),
    ("colour: blue", "colour: unknown field"),
    ("dtype: nvfp4", "dtype: nvfp4 is a precision autotune does not train (it trains bf16, fp16, fp32, fp8, mxfp8)$"),
    ("dtype: bf17", "dtype: must be one of bf16, fp16, fp32, fp8, mxfp8"),
    ("dtype: 16", "dtype: must be str, got int 16"),
    ("moe: {num_experts: 4, top_k: 8, expert_ffn_hidden_size: 8}", "moe.top_k: must be <= moe.num_experts (4), got 8"),
    ("moe: {num_experts: 4, top_k: 1}", "moe.expert_ffn_hidden_size: missing required field"),
    ("moe: {num_experts: 4, top_k: 1, expert_ffn_hidden_size: 8, layers: [0, 9]}", "moe.layers: each entry"),
])
def test_validation_names_the_field_and_the_rule(tmp_path, edit, message):
    key = edit.split(":")[0]
    text = "\n".join(line for line in TINY.splitlines() if not line.startswith(key + ":")) + "\n" + edit
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_model(write(tmp_path, "t.yaml", text))


@pytest.mark.parametrize("written, canonical", [
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"), ("float16", "fp16"), ("half", "fp16"),
    ("float32", "fp32"), ("fp32", "fp32"), ("fp8", "fp8"), ("fp8_e4m3", "fp8"), ("float8_e4m3fn", "fp8"),
    ("fp8-e4m3", "fp8"), ("mxfp8", "mxfp8"), ("MXFP8", "mxfp8"),
])
def test_dtype_spellings_load(tmp_path, written, canonical):
    text = "\n".join(line for line in TINY.splitlines() if not line.startswith("dtype:")) + f"\ndtype: {written}"
    assert load_model(write(tmp_path, "t.yaml", text)).dtype == canonical
    assert trained_dtype(load_model("tiny"), "cpu", written) == canonical  # --dtype reads the same words


def test_missing_field(tmp_path):
    text = "\n".join(line for line in TINY.splitlines() if not line.startswith("seq_len"))
    with pytest.raises(UsageError, match="^seq_len: missing required field"):
        load_model(write(tmp_path, "t.yaml", text))


def test_malformed_yaml_names_the_line(tmp_path):
    with pytest.raises(UsageError, match=r"malformed YAML at line 2: mapping values are not allowed"):
        load_model(write(tmp_path, "bad.yaml", "name: x\nvocab_size: 3: 4\n"))


def test_not_a_mapping_and_unknown_preset(tmp_path):
    with pytest.raises(UsageError, match="must hold a mapping"):
        load_model(write(tmp_path, "list.yaml", "- 1\n- 2\n"))
    with pytest.raises(UsageError, match="unknown preset 'llama9'"):
        load_model("llama9")
    with pytest.raises(UsageError, match="no such file"):
        load_model(str(tmp_path / "missing.yaml"))


LLAMA_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
MIXTRAL_HF = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16",
}
QWEN3_MOE_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06, "rope_theta": 1e6, "tie_word_embeddings": False,
}


def test_hf_llama_matches_the_preset(tmp_path):
    (tmp_path / "Meta-Llama-3-8B").mkdir()
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.write_text(json.dumps(LLAMA_HF))
    m = load_model(str(path))
    preset = load_model("llama3-8b")
    assert m.name == "Meta-Llama-3-8B"
    assert m.num_params() == preset.num_params()
    assert (m.num_kv_heads, m.head_dim, m.rope_theta, m.seq_len) == (8, 128, 500000.0, 4096)


def test_hf_mixtral_becomes_moe(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_HF))
    m = load_model(str(path))
    assert m.moe.num_experts == 8 and m.moe.top_k == 2 and m.moe.expert_ffn_hidden_size == 14336
    assert m.moe.aux_loss_weight == 0.02 and m.num_moe_layers == 32
    assert m.num_params() == load_model("mixtral-8x7b").num_params()


def test_hf_qwen3_moe_and_yaml_overrides(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE_HF))
    yaml_path = write(tmp_path, "qwen.yaml", "hf_config: config.json\nseq_len: 2048\nglobal_batch_size: 64\n")
    m = load_model(yaml_path)
    assert (m.name, m.seq_len, m.global_batch_size, m.head_dim) == ("qwen", 2048, 64, 128)
    assert m.moe.num_experts == 128 and m.moe.top_k == 8 and m.moe.layers == "all"
    assert m.num_params() == load_model("qwen3-30b-a3b").num_params()


def test_hf_config_that_is_not_a_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"foo": 1}))
    with pytest.raises(UsageError, match="not a Hugging Face model config"):
        load_model(str(path))


def test_flops_per_token_by_hand():
    m = load_model("llama3-8b")
    h, kv, ffn, layers, vocab, s = 4096, 1024, 14336, 32, 128256, 8192
    active = layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) + vocab * h
    assert m.flops_per_token() == 6 * active + 12 * layers * 32 * 128 * s


def test_hardware_presets_and_custom(tmp_path):
    h100 = load_hardware("h100-sxm")
    assert (h100.peak_tflops, h100.memory_gb, h100.gpus_per_host, h100.scale_up_gpus) == (989, 80, 8, 8)
    assert hardware_for_device_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert hardware_for_device_name("NVIDIA GeForce RTX 4090") is None
    custom = load_hardware(write(tmp_path, "mine.yaml", "peak_tflops: 100\nmemory_gb: 24\ngpus_per_node: 4\n"
                                                          "intra_node_gbps: 32\ninter_node_gbps: 12.5\n"))
    # The names of a file written before scale-up domains: the domain is the host.
    assert custom.name == "mine" and custom.scale_out_gbps == 12.5 and custom.scale_up_gpus == 4
    assert custom.matmul_tflops("fp8") == 100  # no table: every precision at peak_tflops
    with pytest.raises(UsageError, match="^gpus_per_host: must be a positive integer"):
        load_hardware(write(tmp_path, "bad.yaml", "peak_tflops: 1\nmemory_gb: 1\ngpus_per_node: 0\n"
                                                   "intra_node_gbps: 1\ninter_node_gbps: 1\n"))


MLA = ("attention: mla\nnum_kv_heads: 4\n"
       "mla: {kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8}")


@pytest.mark.parametrize("edit, message", [
    ("mlp: swish", "mlp: must be one of swiglu, geglu, gelu, relu2, got 'swish'"),
    ("attention: mha", "attention: must be one of gqa, mla, got 'mha'"),
    ("attention: mla", "mla: required with attention: mla"),
    ("mla: {kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8}",
     "mla: only with attention: mla, got attention: gqa"),
    (MLA.replace("qk_rope_head_dim: 4", "qk_rope_head_dim: 3"), "mla.qk_rope_head_dim: must be even"),
    (MLA.replace("kv_lora_rank: 16", "kv_lora_rank: 0"), "mla.kv_lora_rank: must be a positive integer, got 0"),
    (MLA.replace("num_kv_heads: 4", "num_kv_heads: 2"), "num_kv_heads: must equal num_heads (4) with attention: mla"),
    (MLA + "\nhead_dim: 8", "head_dim: with attention: mla it is qk_nope_head_dim + qk_rope_head_dim (12), got 8"),
    (MLA + "\nqk_norm: true", "qk_norm: not with attention: mla"),
    ("sliding_window: 0", "sliding_window: must be a positive integer, got 0"),
    ("sliding_window_layers: [0]", "sliding_window_layers: needs sliding_window"),
    ("sliding_window: 8\nsliding_window_layers: [0, 2]", "sliding_window_layers: each entry must be a distinct"),
    ("sliding_window: 8\nsliding_window_layers: [1, 1]", "sliding_window_layers: each entry must be a distinct"),
    ("qk_norm: yes please", "qk_norm: must be bool, got str 'yes please'"),
    ("bias: some", "bias: must be one of none, qkv, all, got 'some'"),
    ("norm: batchnorm", "norm: must be one of rmsnorm, layernorm, got 'batchnorm'"),
    ("learned_positions: 8", "seq_len: must be <= learned_positions (8), got 16"),
    ("mla: [1]", "mla: must be a mapping, got list"),
    ("moe: {num_experts: 4, top_k: 1, expert_ffn_hidden_size: 8, num_shared_experts: -1}",
     "moe.num_shared_experts: must be >= 0, got -1"),
])
def test_model_kinds_are_validated_by_field_and_rule(tmp_path, edit, message):
    text = TINY + edit + "\n"
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        load_model(write(tmp_path, "t.yaml", text))


def test_model_kinds_defaults_and_windows(tmp_path):
    m = load_model(write(tmp_path, "t.yaml", TINY))
    assert (m.mlp, m.attention, m.mla, m.sliding_window, m.qk_norm, m.bias, m.norm) == \
        ("swiglu", "gqa", None, None, False, "none", "rmsnorm")
    assert [m.window(i) for i in range(2)] == [None, None]
    w = load_model(write(tmp_path, "w.yaml", TINY + "sliding_window: 8\nsliding_window_layers: [1]\n"))
    assert [w.window(i) for i in range(2)] == [None, 8]
    mla = load_model(write(tmp_path, "m.yaml", TINY + MLA + "\n"))
    assert mla.head_dim == 12 and mla.mla.q_lora_rank is None


def test_gradients_train_in_fp32_or_the_compute_dtype(tmp_path):
    base = "\n".join(line for line in TINY.splitlines() if not line.startswith("dtype:"))
    model = load_model(write(tmp_path, "g.yaml", base + "\ndtype: bf16\ngrad_dtype: bfloat16"))
    assert model.grad_dtype == "bf16"
    assert as_trained(model, "cuda").grad_dtype == "bf16"
    assert as_trained(model, "cuda", "fp8").grad_dtype == "bf16"  # fp8 computes in bf16
    assert as_trained(model, "cpu").grad_dtype == "fp32"  # a CPU trial is fp32 throughout
    assert as_trained(model, "cuda", "fp16").grad_dtype == "fp32"  # not bf16 gradients of an fp16 model
    assert as_trained(model, "cpu", "bf16", "fp32").grad_dtype == "fp32"
    with pytest.raises(UsageError, match=r"^--grad-dtype: with dtype fp32 must be fp32, got 'bf16'$"):
        as_trained(model, "cpu", None, "bf16")
    with pytest.raises(UsageError, match=r"^grad_dtype: with dtype bf16 must be bf16 or fp32, got 'fp16'$"):
        load_model(write(tmp_path, "h.yaml", base + "\ndtype: bf16\ngrad_dtype: fp16"))
