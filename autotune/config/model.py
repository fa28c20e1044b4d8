"""Model descriptions: YAML or a Hugging Face config.json -> a validated ModelConfig.

A model is a handful of architecture numbers plus the batch it trains with; nothing
here imports torch, so the estimator and the study can price thousands of layouts
from these numbers alone. Every check names the field and the rule, because a user
who typed `hidden_size: -4` wants to know which line to fix, not a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from autotune.config import model_size
from autotune.config.dtypes import compute_dtype_name, parse_dtype, parse_grad_dtype
from autotune.config.files import build, positive, read_mapping, resolve_file
from autotune.config.hf_config import from_hf_config
from autotune.config.hybrid import MambaConfig, validate_hybrid
from autotune.errors import UsageError

R = TypeVar("R")
PRESET_DIR = Path(__file__).resolve().parent.parent / "models"


def per_model_object(fn: Callable[..., R]) -> Callable[..., R]:
    """Memoise fn(model, *args) by the model object (a ModelConfig holds lists, so it has no
    hash): the estimator asks for per-model figures for every layout it prices. The entry
    keeps its model alive, so an id is never reused while it is cached; 64 entries at most.
    `fn.cache_clear()` empties it (benchmarks time cold runs)."""
    cache: dict[tuple, tuple] = {}

    @functools.wraps(fn)
    def memoised(model: Any, *args: Any) -> R:
        key = (id(model), *args)
        hit = cache.get(key)
        if hit is None or hit[0] is not model:
            if len(cache) > 64:
                cache.clear()
            hit = cache[key] = (model, fn(model, *args))
        return hit[1]

    memoised.cache_clear = cache.clear  # type: ignore[attr-defined]
    return memoised

@dataclass(frozen=True)
class MoEConfig:
    """Token-choice top-k Mixture-of-Experts block, used in place of the dense MLP."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    num_shared_experts: int = 0
    # "all", or the indices of the layers whose MLP is an MoE block (the others stay dense).
    layers: str | list = "all"
    aux_loss_weight: float = 0.01

    def validate(self, num_layers: int) -> None:
        for name in ("num_experts", "top_k", "expert_ffn_hidden_size"):
            positive(f"moe.{name}", getattr(self, name))
        if self.num_shared_experts < 0:
            raise UsageError(f"moe.num_shared_experts: must be >= 0, got {self.num_shared_experts}")
        if self.top_k > self.num_experts:
            raise UsageError(
                f"moe.top_k: must be <= moe.num_experts ({self.num_experts}), got {self.top_k}")
        if self.aux_loss_weight < 0:
            raise UsageError(f"moe.aux_loss_weight: must be >= 0, got {self.aux_loss_weight}")
        if isinstance(self.layers, str):
            if self.layers != "all":
                raise UsageError(f"moe.layers: must be 'all' or a list of layer indices, got {self.layers!r}")
        else:
            for i in self.layers:
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers:
                    raise UsageError(f"moe.layers: each entry must be a layer index in [0, {num_layers}), got {i!r}")


MLP_KINDS = ("swiglu", "geglu", "gelu", "relu2")
ATTENTION_KINDS = ("gqa", "mla")
BIAS_KINDS = ("none", "qkv", "all")
NORM_KINDS = ("rmsnorm", "layernorm")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2/V3 multi-head latent attention: keys and values are rebuilt per head
    from one small latent vector per token, so the KV cache and projections are low-rank.

        q    = up_q(norm(down_q(x)))  or  wq(x) when q_lora_rank is null (no compression)
        kv   = down_kv(x): kv_lora_rank latent + qk_rope_head_dim shared RoPE key
        k, v = up_kv(norm(latent)): per head qk_nope_head_dim key and v_head_dim value
    Query and key heads are qk_nope_head_dim + qk_rope_head_dim wide; values v_head_dim.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            positive(f"mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            positive("mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise UsageError(f"mla.qk_rope_head_dim: must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder and its batch: RoPE, GQA or MLA attention, a dense (SwiGLU, GeGLU, GELU,
    squared-ReLU) or MoE MLP, optional sliding windows and QK-norm.

    The defaults are a Llama: RMSNorm, no biases, SwiGLU, full causal GQA attention.
    `bias`, `norm` and `learned_positions` describe the GPT-2 / NeoX / Phi / Qwen2 /
    GPT-OSS families exactly enough to count their parameters; the runtime trains only
    the defaults of those three (config/trainable.py says what it refuses).
    With `hybrid_pattern` it is a stack of single-mixer blocks, Mamba-2 among them
    (config/hybrid.py): the attention fields then describe its `*` blocks.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    seq_len: int
    global_batch_size: int
    num_kv_heads: int | None = None  # None: same as num_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_heads
    dtype: str = "bf16"  # the training precision on a GPU; CPU trials run in fp32
    grad_dtype: str = "fp32"  # GRAD_DTYPES: fp32, or the compute dtype of a mixed-precision dtype
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    mlp: str = "swiglu"
    attention: str = "gqa"
    mla: MLAConfig | None = None
    sliding_window: int | None = None  # local causal attention over the last W tokens
    sliding_window_layers: list | None = None  # which layers (None: all) when sliding_window is set
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3, OLMo 2, Gemma 3)
    bias: str = "none"  # none; qkv: the q, k, v projections (Qwen2); all: every linear but the head
    norm: str = "rmsnorm"  # rmsnorm (a weight) or layernorm (a weight and a bias)
    learned_positions: int = 0  # rows of a learned absolute position table (GPT-2); 0: none
    moe: MoEConfig | None = None
    # Hybrid Mamba-2 / Transformer (config/hybrid.py): one block per character, M * - E.
    hybrid_pattern: str | None = None
    mamba: MambaConfig | None = None

    def __post_init__(self):
        # Derived defaults: written back so every reader sees the same numbers.
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None and isinstance(self.num_heads, int) and self.num_heads > 0:
            if self.attention == "mla" and isinstance(self.mla, MLAConfig):
                object.__setattr__(self, "head_dim", self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)
            else:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_hidden_size", "seq_len", "global_batch_size"):
            positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise UsageError(
                f"num_kv_heads: must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))  # bfloat16 -> bf16, ...
        object.__setattr__(self, "grad_dtype", parse_grad_dtype(self.grad_dtype, self.dtype))
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise UsageError("norm_eps and rope_theta: must be positive")
        for name, kinds in (("mlp", MLP_KINDS), ("attention", ATTENTION_KINDS), ("bias", BIAS_KINDS),
                            ("norm", NORM_KINDS)):
            if getattr(self, name) not in kinds:
                raise UsageError(f"{name}: must be one of {', '.join(kinds)}, got {getattr(self, name)!r}")
        self._validate_attention()
        if self.learned_positions < 0:
            raise UsageError(f"learned_positions: must be >= 0, got {self.learned_positions}")
        if self.learned_positions and self.learned_positions < self.seq_len:
            raise UsageError(f"seq_len: must be <= learned_positions ({self.learned_positions}), got {self.seq_len}")
        if self.moe is not None:
            self.moe.validate(self.num_layers)
        validate_hybrid(self)
        return self

    def _validate_attention(self) -> None:
        if self.attention == "mla":
            if self.mla is None:
                raise UsageError("mla: required with attention: mla (kv_lora_rank, qk_nope_head_dim, "
                                 "qk_rope_head_dim, v_head_dim, q_lora_rank)")
            self.mla.validate()
            if self.num_kv_heads != self.num_heads:
                raise UsageError(f"num_kv_heads: must equal num_heads ({self.num_heads}) with attention: mla "
                                 f"(every head has its own key and value), got {self.num_kv_heads}")
            if self.head_dim != self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim:
                raise UsageError(f"head_dim: with attention: mla it is qk_nope_head_dim + qk_rope_head_dim "
                                 f"({self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim}), got {self.head_dim}")
            if self.qk_norm:
                raise UsageError("qk_norm: not with attention: mla (MLA normalises its latents instead)")
            if self.bias != "none":
                raise UsageError(f"bias: must be none with attention: mla, got {self.bias!r}")
        elif self.mla is not None:
            raise UsageError(f"mla: only with attention: mla, got attention: {self.attention}")
        elif self.head_dim % 2 and self.hybrid_pattern is None:
            raise UsageError(f"head_dim: must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.sliding_window is not None:
            positive("sliding_window", self.sliding_window)
        if self.sliding_window_layers is not None:
            if self.sliding_window is None:
                raise UsageError("sliding_window_layers: needs sliding_window (the window's width)")
            seen = set()
            for i in self.sliding_window_layers:
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers or i in seen:
                    raise UsageError(f"sliding_window_layers: each entry must be a distinct layer index in "
                                     f"[0, {self.num_layers}), got {i!r}")
                seen.add(i)

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe is None:
            return False
        if self.hybrid_pattern is not None:
            return self.hybrid_pattern[layer] == "E"
        return self.moe.layers == "all" or layer in self.moe.layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    # -- sizes (autotune/config/model_size.py has the formulas) -------------------------------------
    def attention_params(self) -> int:
        return model_size.attention_params(self)

    def dense_mlp_params(self) -> int:
        return model_size.mlp_params(self, self.ffn_hidden_size)

    def expert_params(self) -> int:
        """One routed (or shared) expert: an MLP of the model's kind, expert_ffn_hidden_size wide."""
        return model_size.mlp_params(self, self.moe.expert_ffn_hidden_size)

    def mlp_params(self, layer: int, active_only: bool = False) -> int:
        return model_size.layer_mlp_params(self, layer, active_only)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        """Every parameter, as transformers counts them (model_size.num_params)."""
        return model_size.num_params(self)

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        return model_size.num_params(self, active_only=True)

    def active_matmul_params(self) -> int:
        """Matmul weights one token passes through: blocks (top-k experts only) + output head."""
        return model_size.active_matmul_params(self)

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token, forward + backward (model_size.flops_per_token)."""
        return model_size.flops_per_token(self)


# -- loading ---------------------------------------------------------------------------------

def trained_dtype(model: ModelConfig, device: str, dtype: str | None = None) -> str:
    """The precision a trial trains in: `--dtype`, else on CUDA the model's own, else fp32 (a
    CPU trial is the numerics oracle unless asked for the GPU's mixed-precision plan)."""
    if dtype is not None:
        return parse_dtype(dtype, "--dtype")
    return model.dtype if device == "cuda" else "fp32"


def trained_grad_dtype(model: ModelConfig, dtype: str, grad_dtype: str | None = None) -> str:
    """The gradients' precision of a model trained in `dtype`: `--grad-dtype`, else the
    model's own where its dtype trains, else fp32 (an fp32 trial's gradients are fp32)."""
    if grad_dtype is not None:
        return parse_grad_dtype(grad_dtype, dtype, "--grad-dtype")
    return model.grad_dtype if model.grad_dtype in ("fp32", compute_dtype_name(dtype)) else "fp32"


def as_trained(model: ModelConfig, device: str, dtype: str | None = None, grad_dtype: str | None = None) -> ModelConfig:
    """The model with the precisions it trains in (trained_dtype, trained_grad_dtype)."""
    trained = trained_dtype(model, device, dtype)
    return dataclasses.replace(model, dtype=trained, grad_dtype=trained_grad_dtype(model, trained, grad_dtype))


def model_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_model(spec: str) -> ModelConfig:
    """A preset name, a YAML file, or a Hugging Face config.json."""
    path = resolve_file(spec, PRESET_DIR, "model", model_presets())
    data = read_mapping(path)
    if path.suffix == ".json":
        data = from_hf_config(data, name=(path.parent.name or path.stem) if path.stem == "config" else path.stem)
    elif "hf_config" in data:
        # A YAML that starts from a config.json and overrides the training shape.
        base_path = (path.parent / str(data.pop("hf_config"))).resolve()
        base = from_hf_config(read_mapping(base_path), name=path.stem)
        data = {**base, **data}
    data.setdefault("name", path.stem)
    return model_from_dict(data)


def model_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    for key, cls in (("moe", MoEConfig), ("mla", MLAConfig), ("mamba", MambaConfig)):
        block = data.pop(key, None)
        if block is not None:
            if not isinstance(block, dict):
                raise UsageError(f"{key}: must be a mapping, got {type(block).__name__}")
            data[key] = build(cls, block, prefix=f"{key}.")
    return build(ModelConfig, data).validate()


