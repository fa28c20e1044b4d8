"""A Hugging Face config.json -> our model fields, exactly or not at all.

A config that loads wrong is worse than one refused: the estimator would price a
different model and the sweep pick its layout. So `model_type` (or, lacking it, the
`architectures` class) is read first and each supported family is translated by its
own rules, with transformers' defaults where a key is absent; anything else exits 2
naming the architecture. tests/test_param_counts.py checks every family against
transformers' own parameter count.

What each family needs beyond the Llama keys:

    mistral, mixtral, phi3   a sliding window on every layer when `sliding_window` is set;
                             Mixtral: `num_local_experts` experts of `intermediate_size`
    qwen2, qwen2_moe         biases on q, k, v; Qwen2-MoE: `num_experts` of
                             `moe_intermediate_size`, shared experts of
                             `shared_expert_intermediate_size`, `decoder_sparse_step`,
                             `mlp_only_layers`
    qwen3, qwen3_moe         per-head QK-norm; Qwen3-MoE: `num_experts` (hub) or
                             `num_local_experts` (transformers 5), both of
                             `moe_intermediate_size`
    deepseek_v3, kimi_k2     MLA (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
                             `qk_rope_head_dim`, `v_head_dim`); `n_routed_experts`,
                             `n_shared_experts`, dense layers before
                             `first_k_dense_replace` and off `moe_layer_freq`
    gpt_oss                  biases everywhere (experts and router too), experts of
                             `intermediate_size`, alternating sliding windows
    gemma, gemma2, gemma3    GeGLU, tied embeddings; 2 and 3: sliding windows by
                             `layer_types` (or every other layer / five of six); 3: QK-norm
    olmo, olmo2              OLMo 2: QK-norm
    phi, gpt_neox, gpt2      plain GELU MLP, LayerNorm, biases everywhere; GPT-2's own keys
                             (`n_layer`, `n_embd`, `n_head`, `n_inner`, `n_positions`) and
                             its learned position table
    nemotron                 squared-ReLU MLP, LayerNorm
    nemotron_h               hybrid Mamba-2 / attention / MLP / MoE blocks (config/hybrid.py),
                             `hybrid_override_pattern` or transformers 5's `layers_block_type`;
                             qwen3_next, jamba and falcon_h1 are refused by name

transformers 5 writes `rope_theta` inside `rope_parameters` and `dtype` for
`torch_dtype`; both are read. What is kept is the model's shape: numerical details
that change neither parameters nor FLOPs (RoPE scaling, partial rotary dimensions,
logit soft-capping, query scaling, GPT-OSS's clamped SwiGLU) are not carried over.
"""

from __future__ import annotations

from autotune.config.hybrid import OTHER_HYBRIDS, from_nemotron_h
from autotune.errors import UsageError

HF_DEFAULT_SEQ_LEN = 4096
HF_DEFAULT_GLOBAL_BATCH = 256

# model_type -> (our mlp kind's family: gated or plain, tie_word_embeddings default, rope_theta default)
FAMILIES = {
    "llama": ("gated", False, 10000.0), "mistral": ("gated", False, 10000.0),
    "mixtral": ("gated", False, 1e6), "qwen2": ("gated", False, 10000.0), "qwen2_moe": ("gated", False, 10000.0),
    "qwen3": ("gated", False, 10000.0), "qwen3_moe": ("gated", False, 10000.0),
    "deepseek_v3": ("gated", False, 10000.0), "kimi_k2": ("gated", False, 10000.0),
    "gpt_oss": ("gated", False, 150000.0), "gemma": ("gated", True, 10000.0), "gemma2": ("gated", True, 10000.0),
    "gemma3_text": ("gated", True, 1e6), "phi3": ("gated", False, 10000.0), "olmo": ("gated", False, 10000.0),
    "olmo2": ("gated", False, 10000.0), "phi": ("plain", False, 10000.0), "gpt_neox": ("plain", False, 10000.0),
    "gpt2": ("plain", True, 10000.0), "nemotron": ("plain", False, 10000.0),
}
# The class names of those families, for a config.json without model_type.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3", "GptOssForCausalLM": "gpt_oss",
    "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3", "OlmoForCausalLM": "olmo", "Olmo2ForCausalLM": "olmo2", "PhiForCausalLM": "phi",
    "GPTNeoXForCausalLM": "gpt_neox", "GPT2LMHeadModel": "gpt2", "NemotronForCausalLM": "nemotron",
    "NemotronHForCausalLM": "nemotron_h",
}
# hidden_act -> mlp kind, by family (anything else is refused).
ACTIVATIONS = {
    "gated": {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu",
              "gelu_new": "geglu"},
    "plain": {"gelu": "gelu", "gelu_new": "gelu", "gelu_fast": "gelu", "gelu_pytorch_tanh": "gelu",
              "relu2": "relu2"},
}
_ROPE_FREE = ("gpt2",)  # learned positions instead


def from_hf_config(hf: dict, name: str) -> dict:
    """Translate a Hugging Face config.json into our field names (a dict, validated later).

    A config.json describes the architecture, not the training run, so seq_len is the
    model's context capped at 4096 and global_batch_size 256; a YAML with `hf_config:`
    overrides both.
    """
    model_type = _model_type(hf, name)
    if model_type == "nemotron_h":
        return {**from_nemotron_h(hf, name), "seq_len": min(int(hf.get("max_position_embeddings") or
                                                             HF_DEFAULT_SEQ_LEN), HF_DEFAULT_SEQ_LEN),
                "global_batch_size": HF_DEFAULT_GLOBAL_BATCH,
                "dtype": "fp32" if (hf.get("dtype") or hf.get("torch_dtype")) == "float32" else "bf16"}
    if model_type == "gpt2":
        hf = _gpt2_keys(hf)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if hf.get(key) is None:
            raise UsageError(f"{name}: {key}: missing from the {model_type} config.json")
    family, tie_default, theta_default = FAMILIES[model_type]
    layers = int(hf["num_hidden_layers"])
    out = {
        "name": name,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": layers,
        "num_heads": hf["num_attention_heads"],
        "ffn_hidden_size": hf.get("intermediate_size") or 4 * hf["hidden_size"],
        "seq_len": min(int(hf.get("max_position_embeddings") or HF_DEFAULT_SEQ_LEN), HF_DEFAULT_SEQ_LEN),
        "global_batch_size": HF_DEFAULT_GLOBAL_BATCH,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", tie_default)),
        "mlp": _mlp_kind(hf, model_type, family, name),
    }
    if hf.get("num_key_value_heads") is not None:
        out["num_kv_heads"] = hf["num_key_value_heads"]
    if hf.get("head_dim") is not None and model_type not in ("deepseek_v3", "kimi_k2"):
        out["head_dim"] = hf["head_dim"]
    eps = next((hf[k] for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
                if hf.get(k) is not None), None)
    if eps is not None:
        out["norm_eps"] = eps
    if model_type not in _ROPE_FREE:
        out["rope_theta"] = float(_rope_theta(hf, theta_default))
    dtype = hf.get("dtype") or hf.get("torch_dtype")
    out["dtype"] = "fp32" if dtype == "float32" else "bf16"
    out.update(_biases_and_norms(hf, model_type, name))
    if model_type in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"):
        out["qk_norm"] = True
    out.update(_windows(hf, model_type, layers, name))
    if model_type in ("deepseek_v3", "kimi_k2"):
        out.update(_mla(hf, name))
    moe = _moe(hf, model_type, layers, name)
    if moe is not None:
        out["moe"] = moe
    return out


def _model_type(hf: dict, name: str) -> str:
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type is None and architectures:
        model_type = ARCHITECTURES.get(architectures[0])
        if model_type is None:
            raise UsageError(f"{name}: architecture {architectures[0]} is not supported "
                             f"(supported model types: {', '.join(FAMILIES)}, nemotron_h)")
    if model_type is None:
        if "num_hidden_layers" in hf or "n_layer" in hf:
            raise UsageError(f"{name}: config.json names no model_type or architectures: cannot tell "
                             "which architecture it is")
        raise UsageError(f"{name}: not a Hugging Face model config (no model_type, architectures or "
                         "num_hidden_layers)")
    if model_type in OTHER_HYBRIDS:
        raise UsageError(f"{name}: architecture {model_type} is not supported ({OTHER_HYBRIDS[model_type]} is not "
                         "built; nemotron_h is the hybrid supported)")
    if model_type not in FAMILIES and model_type != "nemotron_h":
        what = f"{model_type} ({architectures[0]})" if architectures else model_type
        raise UsageError(f"{name}: architecture {what} is not supported (supported model types: "
                         f"{', '.join(FAMILIES)}, nemotron_h)")
    return model_type


def _gpt2_keys(hf: dict) -> dict:
    """GPT-2's config names its sizes its own way; n_inner null means 4 * n_embd."""
    out = dict(hf)
    for theirs, ours in (("n_layer", "num_hidden_layers"), ("n_embd", "hidden_size"),
                         ("n_head", "num_attention_heads"), ("n_inner", "intermediate_size"),
                         ("n_positions", "max_position_embeddings"), ("activation_function", "hidden_act")):
        if theirs in hf:
            out[ours] = hf[theirs]
    out.setdefault("hidden_act", "gelu_new")
    out.setdefault("max_position_embeddings", 1024)
    return out


def _mlp_kind(hf: dict, model_type: str, family: str, name: str) -> str:
    act = hf.get("hidden_activation") if model_type.startswith("gemma") else None
    act = act or hf.get("hidden_act") or {"gated": "silu", "plain": "gelu"}[family]
    if model_type == "nemotron" and "hidden_act" not in hf:
        act = "relu2"
    kind = ACTIVATIONS[family].get(act)
    if kind is None:
        raise UsageError(f"{name}: hidden_act {act!r} is not supported for {model_type} "
                         f"(supported: {', '.join(ACTIVATIONS[family])})")
    return kind


def _rope_theta(hf: dict, default: float) -> float:
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        if params.get("rope_theta") is not None:
            return params["rope_theta"]
        # Gemma 3 in transformers 5: one entry per attention type; the full layers' base.
        full = params.get("full_attention")
        if isinstance(full, dict) and full.get("rope_theta") is not None:
            return full["rope_theta"]
    for key in ("rope_theta", "rotary_emb_base"):
        if hf.get(key) is not None:
            return hf[key]
    return default


def _biases_and_norms(hf: dict, model_type: str, name: str) -> dict:
    if model_type in ("phi", "gpt_neox", "gpt2"):
        if model_type == "gpt_neox" and not hf.get("attention_bias", True):
            raise UsageError(f"{name}: attention_bias false is not supported for gpt_neox (its MLP keeps biases)")
        return {"bias": "all", "norm": "layernorm",
                **({"learned_positions": int(hf["max_position_embeddings"])} if model_type == "gpt2" else {})}
    out = {"norm": "layernorm"} if model_type == "nemotron" else {}
    if model_type == "gpt_oss":
        out["bias"] = "all"
    elif model_type == "qwen2":
        out["bias"] = "qkv"
    elif model_type == "qwen2_moe":
        out["bias"] = "qkv" if hf.get("qkv_bias", True) else "none"
    else:
        attention, mlp = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
        if attention != mlp:
            raise UsageError(f"{name}: attention_bias {str(attention).lower()} with mlp_bias {str(mlp).lower()} "
                             "is not supported (biases on both or on neither)")
        if attention:
            out["bias"] = "all"
    return out


def _windows(hf: dict, model_type: str, layers: int, name: str) -> dict:
    """sliding_window and the layers that use it, as transformers decides them."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if hf.get("use_sliding_window"):
            raise UsageError(f"{name}: use_sliding_window is not supported for {model_type}")
        return {}
    if model_type in ("deepseek_v3", "kimi_k2", "olmo", "olmo2", "phi", "gpt_neox", "gpt2", "nemotron", "llama",
                      "gemma"):
        if types and any(t != "full_attention" for t in types):
            raise UsageError(f"{name}: layer_types other than full_attention are not supported for {model_type}")
        return {}
    if window is None:
        return {}
    if types is None:
        if model_type in ("gemma2", "gpt_oss"):
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif model_type == "gemma3_text":
            pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:  # mistral, mixtral, phi3: every layer
            types = ["sliding_attention"] * layers
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise UsageError(f"{name}: layer_types must list sliding_attention or full_attention for each of "
                         f"{layers} layers, got {unknown or len(types)}")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not sliding:
        return {}
    out = {"sliding_window": int(window)}
    if len(sliding) < layers:
        out["sliding_window_layers"] = sliding
    return out


def _mla(hf: dict, name: str) -> dict:
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for key in keys:
        if hf.get(key) is None:
            raise UsageError(f"{name}: {key}: missing from the MLA config.json")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise UsageError(f"{name}: num_key_value_heads {kv_heads} differs from num_attention_heads {heads}: "
                         "not supported with MLA")
    if hf.get("attention_bias"):
        raise UsageError(f"{name}: attention_bias is not supported with MLA")
    return {"attention": "mla", "num_kv_heads": heads,
            "mla": {**{k: hf[k] for k in keys}, "q_lora_rank": hf.get("q_lora_rank")}}


def _moe(hf: dict, model_type: str, layers: int, name: str) -> dict | None:
    """The MoE block and which layers have it (the others keep the dense MLP)."""
    if model_type in ("mixtral", "gpt_oss"):
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        top_k = hf.get("num_experts_per_tok") or hf.get("experts_per_token") or (2 if model_type == "mixtral" else 4)
        return {"num_experts": experts, "top_k": top_k, "expert_ffn_hidden_size": hf["intermediate_size"],
                "aux_loss_weight": hf.get("router_aux_loss_coef", 0.01 if model_type == "mixtral" else 0.9)}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        width = hf.get("moe_intermediate_size")
        if not experts or not width:
            raise UsageError(f"{name}: {model_type} needs num_experts (or num_local_experts) and "
                             "moe_intermediate_size")
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        moe = {"num_experts": experts, "top_k": hf.get("num_experts_per_tok", 4 if model_type == "qwen2_moe" else 8),
               "expert_ffn_hidden_size": width, "aux_loss_weight": hf.get("router_aux_loss_coef", 0.001),
               "layers": "all" if len(moe_layers) == layers else moe_layers}
        shared = hf.get("shared_expert_intermediate_size") or 0
        if shared:
            if shared % width:
                raise UsageError(f"{name}: shared_expert_intermediate_size {shared} is not a multiple of "
                                 f"moe_intermediate_size {width}: not supported")
            moe["num_shared_experts"] = shared // width
        return moe
    if model_type in ("deepseek_v3", "kimi_k2"):
        experts = hf.get("n_routed_experts") or hf.get("num_local_experts")
        if not experts:
            return None
        first_dense = int(hf.get("first_k_dense_replace") or 0)
        freq = int(hf.get("moe_layer_freq") or 1)
        moe_layers = [i for i in range(layers) if i >= first_dense and i % freq == 0]
        return {"num_experts": experts, "top_k": hf.get("num_experts_per_tok", 8),
                "expert_ffn_hidden_size": hf["moe_intermediate_size"],
                "num_shared_experts": int(hf.get("n_shared_experts") or 0),
                "aux_loss_weight": hf.get("aux_loss_alpha", 0.001),
                "layers": "all" if len(moe_layers) == layers else moe_layers}
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hf.get(key):
            raise UsageError(f"{name}: {key} in a {model_type} config.json: experts are not supported there")
    return None
