"""Model and hardware descriptions: YAML or a Hugging Face config.json -> validated dataclasses.

A model is a handful of architecture numbers plus the batch it trains with; nothing
here imports torch, so the estimator and the study can price thousands of layouts
from these numbers alone. Every check names the field and the rule, because a user
who typed `hidden_size: -4` wants to know which line to fix, not a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from autotune import model_size
from autotune.errors import UsageError
from autotune.hf_config import from_hf_config

GIB = 2**30  # memory_gb, budgets and every reported GiB figure


def human_bytes(n: float) -> str:
    """1.23 GiB, 45.00 MiB, 12 B: a memory figure as a person reads it."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


PRESET_DIR = Path(__file__).parent / "models"
HARDWARE_DIR = Path(__file__).parent / "hardware"
# The precisions a model trains in. fp16 trains with a loss scaler; fp8 and mxfp8 run the
# linear layers' matmuls in 8-bit floats (per-tensor or per-row scales; per-32-element
# block scales) on bf16 compute, with fp32 masters and optimizer state as bf16 has.
DTYPES = ("bf16", "fp16", "fp32", "fp8", "mxfp8")
# The spellings people use for them: Hugging Face's torch_dtype, torch's names, fp8 formats.
DTYPE_SPELLINGS = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp8": "fp8", "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e4m3fn": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8",
    "fp8_hybrid": "fp8",  # Transformer Engine's e4m3 forward, e5m2 gradients: torchao's recipes do the same
    "mxfp8": "mxfp8", "mx_fp8": "mxfp8", "mxfp8_e4m3": "mxfp8",
}
# What the gradients are accumulated, reduced and kept in under mixed precision: fp32 (the
# default, Megatron-LM's `grad_reduce_in_fp32`, torchtitan's `mixed_precision_reduce`), or
# the compute dtype (bf16 or fp16), as NVIDIA's Megatron-Bridge performance recipes train.
GRAD_DTYPES = ("fp32", "bf16", "fp16")
# Precisions people train in that this tool does not: named so that the refusal says so.
UNTRAINED_DTYPES = ("nvfp4", "mxfp4", "fp4", "mxfp6", "fp6", "int8", "int4", "fp64", "float64", "tf32")


def parse_dtype(value, field: str = "dtype") -> str:
    """The canonical name (DTYPES) of a precision as people write it (DTYPE_SPELLINGS); a
    precision this tool does not train, or no precision at all, is a usage error naming it."""
    key = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
    if key in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[key]
    if key in UNTRAINED_DTYPES:
        raise UsageError(f"{field}: {value} is a precision autotune does not train "
                         f"(it trains {', '.join(DTYPES)})")
    raise UsageError(f"{field}: must be one of {', '.join(DTYPES)} (or bfloat16, float16, float32, fp8_e4m3), "
                     f"got {value!r}")


def compute_dtype_name(dtype: str) -> str:
    """The dtype a model trained in `dtype` computes in: fp8 and mxfp8 compute in bf16."""
    return "bf16" if dtype in ("fp8", "mxfp8") else dtype


def parse_grad_dtype(value, dtype: str, field: str = "grad_dtype") -> str:
    """The gradients' precision (GRAD_DTYPES) for a model trained in `dtype`: fp32, or the
    compute dtype itself (bf16 gradients of an fp16 model, or below fp32 in an fp32 one,
    are refused: no framework trains so)."""
    allowed = sorted({"fp32", compute_dtype_name(dtype)})
    key = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
    name = DTYPE_SPELLINGS.get(key)
    if name not in allowed:
        raise UsageError(f"{field}: with dtype {dtype} must be {' or '.join(allowed)}, got {value!r}")
    return name



def per_model_object(fn):
    """Memoise fn(model, *args) by the model object (a ModelConfig holds lists, so it has no
    hash): the estimator asks for per-model figures for every layout it prices. The entry
    keeps its model alive, so an id is never reused while it is cached; 64 entries at most.
    `fn.cache_clear()` empties it (benchmarks time cold runs)."""
    cache: dict[tuple, tuple] = {}

    @functools.wraps(fn)
    def memoised(model, *args):
        key = (id(model), *args)
        hit = cache.get(key)
        if hit is None or hit[0] is not model:
            if len(cache) > 64:
                cache.clear()
            hit = cache[key] = (model, fn(model, *args))
        return hit[1]

    memoised.cache_clear = cache.clear
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
            _positive(f"moe.{name}", getattr(self, name))
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
            _positive(f"mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise UsageError(f"mla.qk_rope_head_dim: must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder and its batch: RoPE, GQA or MLA attention, a dense (SwiGLU, GeGLU, GELU,
    squared-ReLU) or MoE MLP, optional sliding windows and QK-norm.

    The defaults are a Llama: RMSNorm, no biases, SwiGLU, full causal GQA attention.
    `bias`, `norm` and `learned_positions` describe the GPT-2 / NeoX / Phi / Qwen2 /
    GPT-OSS families exactly enough to count their parameters; the runtime trains only
    the defaults of those three (runtime/support.py says what it refuses).
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
            _positive(name, getattr(self, name))
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
        elif self.head_dim % 2:
            raise UsageError(f"head_dim: must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
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

    # -- sizes (autotune/model_size.py has the formulas) -------------------------------------
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


@dataclass(frozen=True)
class HardwareConfig:
    """What a device and its cluster can do: the numbers the estimator, MFU and the layout rules need.

    Two domains matter and they are not the same on rack-scale systems: the host (a machine
    and its GPUs, what a launcher starts processes on) and the scale-up domain (the GPUs that
    share NVLink or Infinity Fabric). On an HGX/DGX or an MI300X platform both are 8 GPUs; on
    a GB200 or GB300 NVL72 rack a host holds 4 GPUs and the NVLink domain spans all 72 of the
    rack. "Inside a node" in the layout rules, the estimator and the report means inside the
    scale-up domain: that is where TP's all-reduces and EP's all-to-alls are cheap.
    """

    name: str
    peak_tflops: float  # dense bf16 (fp32 for cpu), per device: MFU's denominator; 0 = measure by calibration
    memory_gb: float  # GiB per device; 0 = no limit known (the CPU)
    gpus_per_host: int  # processes a launcher starts on one machine
    scale_up_gpus: int  # GPUs that share NVLink / Infinity Fabric (NVL72: 72); a multiple of gpus_per_host
    scale_up_gbps: float  # GB/s per device, one direction, inside the scale-up domain
    scale_out_gbps: float  # GB/s per device, one direction, between scale-up domains (InfiniBand/RoCE)
    # Dense peak TFLOP/s per device by precision (bf16, fp16, fp8, mxfp8, fp32, tf32: those it
    # has). Empty: every precision at peak_tflops (a custom YAML, the calibrated CPU). Left out
    # of the hash (a dict is not hashable); equality still compares it.
    dense_tflops: dict = dataclasses.field(default_factory=dict, hash=False)
    # The fraction of a precision's dense peak that training in it reaches on this device,
    # fitted to published runs (benchmarks/published_runs.py): bf16, fp16, fp32 all of the
    # compute (estimate.Calibration.compute_efficiency); fp8, mxfp8 the 8-bit linears (the rest
    # runs at the bf16 entry). A precision left out keeps the prior. Left out of the hash as
    # dense_tflops is.
    compute_efficiency: dict = dataclasses.field(default_factory=dict, hash=False)

    def validate(self) -> "HardwareConfig":
        _positive("gpus_per_host", self.gpus_per_host)
        _positive("scale_up_gpus", self.scale_up_gpus)
        if self.scale_up_gpus % self.gpus_per_host:
            raise UsageError(f"scale_up_gpus: must be a multiple of gpus_per_host ({self.gpus_per_host}), "
                             f"got {self.scale_up_gpus}")
        for name in ("scale_up_gbps", "scale_out_gbps"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name}: must be a positive number, got {getattr(self, name)}")
        for name in ("peak_tflops", "memory_gb"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for precision, tflops in self.dense_tflops.items():
            if precision not in HARDWARE_PRECISIONS:
                raise UsageError(f"dense_tflops.{precision}: unknown precision "
                                 f"(known: {', '.join(HARDWARE_PRECISIONS)})")
            if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or tflops <= 0:
                raise UsageError(f"dense_tflops.{precision}: must be a positive number, got {tflops!r}")
        for precision, efficiency in self.compute_efficiency.items():
            if precision not in HARDWARE_PRECISIONS:
                raise UsageError(f"compute_efficiency.{precision}: unknown precision "
                                 f"(known: {', '.join(HARDWARE_PRECISIONS)})")
            if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
                raise UsageError(f"compute_efficiency.{precision}: must be a number in (0, 1], got {efficiency!r}")
        return self

    def matmul_tflops(self, dtype: str) -> float:
        """Dense peak of the matmuls of a model trained in `dtype` (DTYPES): fp8 and mxfp8 run
        their linear layers' GEMMs at the device's fp8 or MX rate, fp32 at its fp32 rate (the
        runtime leaves torch's float32 matmuls in full fp32, not TF32). A device without that
        precision refuses, in one line."""
        if not self.dense_tflops:
            return self.peak_tflops
        if dtype not in self.dense_tflops:
            raise UsageError(f"dtype: {self.name} has no {dtype} (it has {', '.join(self.dense_tflops)})")
        return float(self.dense_tflops[dtype])

    def with_gpus_per_host(self, gpus: int) -> "HardwareConfig":
        """--gpus-per-node: hosts of `gpus` GPUs. Where the scale-up domain is the host (HGX,
        MI300X, the CPU), the domain shrinks or grows with it; a rack-scale domain (NVL72)
        stays as it is."""
        domain = gpus if self.scale_up_gpus == self.gpus_per_host else self.scale_up_gpus
        return dataclasses.replace(self, gpus_per_host=gpus, scale_up_gpus=domain)


# Precisions a hardware preset may list (tf32: the tensor-core rate of fp32 inputs, for reference).
HARDWARE_PRECISIONS = ("bf16", "fp16", "fp8", "mxfp8", "fp32", "tf32")
# A hardware description written before scale-up domains: its names -> today's.
_HARDWARE_ALIASES = {"gpus_per_node": "gpus_per_host", "intra_node_gbps": "scale_up_gbps",
                     "inter_node_gbps": "scale_out_gbps"}


def hardware_from_dict(data: dict) -> HardwareConfig:
    """A hardware description (a YAML's fields, or a stored study's): older names accepted,
    the scale-up domain defaulting to the host."""
    data = dict(data)
    for old, new in _HARDWARE_ALIASES.items():
        if old in data:
            if new in data:
                raise UsageError(f"{old}: give {new} only (it replaces {old})")
            data[new] = data.pop(old)
    if "gpus_per_host" in data:
        data.setdefault("scale_up_gpus", data["gpus_per_host"])
    mappings = {}
    for name, what in (("dense_tflops", "TFLOP/s"), ("compute_efficiency", "fraction")):
        mappings[name] = data.pop(name, None) or {}
        if not isinstance(mappings[name], dict):
            raise UsageError(f"{name}: must be a mapping of precision: {what}, got {type(mappings[name]).__name__}")
    return dataclasses.replace(_build(HardwareConfig, data), **{k: dict(v) for k, v in mappings.items()}).validate()


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


def hardware_presets() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_model(spec: str) -> ModelConfig:
    """A preset name, a YAML file, or a Hugging Face config.json."""
    path = _resolve(spec, PRESET_DIR, "model", model_presets())
    data = _read_mapping(path)
    if path.suffix == ".json":
        data = from_hf_config(data, name=(path.parent.name or path.stem) if path.stem == "config" else path.stem)
    elif "hf_config" in data:
        # A YAML that starts from a config.json and overrides the training shape.
        base_path = (path.parent / str(data.pop("hf_config"))).resolve()
        base = from_hf_config(_read_mapping(base_path), name=path.stem)
        data = {**base, **data}
    data.setdefault("name", path.stem)
    return model_from_dict(data)


def model_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    for key, cls in (("moe", MoEConfig), ("mla", MLAConfig)):
        block = data.pop(key, None)
        if block is not None:
            if not isinstance(block, dict):
                raise UsageError(f"{key}: must be a mapping, got {type(block).__name__}")
            data[key] = _build(cls, block, prefix=f"{key}.")
    return _build(ModelConfig, data).validate()


def load_hardware(spec: str) -> HardwareConfig:
    path = _resolve(spec, HARDWARE_DIR, "hardware", hardware_presets())
    data = _read_mapping(path)
    data.setdefault("name", path.stem)
    return hardware_from_dict(data)


def hardware_for_device_name(device_name: str) -> HardwareConfig | None:
    """The preset for a device name such as 'NVIDIA H100 80GB HBM3' or 'AMD Instinct MI300X', if
    we know it (a Grace-Blackwell GPU names itself GB200/GB300: checked before B200/B300)."""
    upper = device_name.upper()
    for key, preset in (("GB300", "gb300"), ("GB200", "gb200"), ("B300", "b300"), ("B200", "b200"),
                        ("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"),
                        ("MI355X", "mi355x"), ("MI300X", "mi300x")):
        if key in upper:
            return load_hardware(preset)
    return None


# -- helpers ---------------------------------------------------------------------------------

def _resolve(spec: str, preset_dir: Path, what: str, presets: list[str]) -> Path:
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise UsageError(f"{what}: no such file {spec}")
        return path
    preset = preset_dir / f"{spec}.yaml"
    if not preset.is_file():
        raise UsageError(f"{what}: unknown preset {spec!r} (presets: {', '.join(presets)})")
    return preset


def _read_mapping(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else getattr(e, "lineno", None)
        problem = getattr(e, "problem", None) or getattr(e, "msg", "")
        where = f" at line {line}" if line else ""
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise UsageError(f"{path}: malformed {kind}{where}: {problem}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: must hold a mapping of fields, got {type(data).__name__}")
    return data


def _build(cls, data: dict, prefix: str = ""):
    """cls(**data) with unknown, missing and mistyped fields reported by name."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise UsageError(f"{prefix}{key}: unknown field (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                raise UsageError(f"{prefix}{name}: missing required field")
            continue
        data[name] = _check_type(prefix + name, data[name], hints[name])
    return cls(**data)


def _check_type(name: str, value, hint):
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    allowed = typing.get_args(hint) if union else (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return value
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
        if t is list and isinstance(value, list):
            return value
        if dataclasses.is_dataclass(t) and isinstance(value, t):
            return value
    names = " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
    raise UsageError(f"{name}: must be {names}, got {type(value).__name__} {value!r}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{name}: must be a positive integer, got {value!r}")
