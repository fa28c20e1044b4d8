"""Model and hardware descriptions: YAML or a Hugging Face config.json -> validated dataclasses.

A model is a handful of architecture numbers plus the batch it trains with; nothing
here imports torch, so the estimator and the study can price thousands of layouts
from these numbers alone. Every check names the field and the rule, because a user
who typed `hidden_size: -4` wants to know which line to fix, not a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from autotune.errors import UsageError

GIB = 2**30  # memory_gb, budgets and every reported GiB figure
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


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU or MoE MLP) and its batch."""

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
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    moe: MoEConfig | None = None

    def __post_init__(self):
        # Derived defaults: written back so every reader sees the same numbers.
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None and isinstance(self.num_heads, int) and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_hidden_size", "seq_len", "global_batch_size"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise UsageError(
                f"num_kv_heads: must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))  # bfloat16 -> bf16, ...
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise UsageError("norm_eps and rope_theta: must be positive")
        if self.moe is not None:
            self.moe.validate(self.num_layers)
        return self

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe is None:
            return False
        return self.moe.layers == "all" or layer in self.moe.layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    # -- sizes ---------------------------------------------------------------------------
    def attention_params(self) -> int:
        """q and o are heads*head_dim wide, k and v kv_heads*head_dim (GQA)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.ffn_hidden_size  # SwiGLU: gate, up, down

    def expert_params(self) -> int:
        """One routed expert (a SwiGLU of expert_ffn_hidden_size)."""
        return 3 * self.hidden_size * self.moe.expert_ffn_hidden_size

    def mlp_params(self, layer: int, active_only: bool = False) -> int:
        if not self.is_moe_layer(layer):
            return self.dense_mlp_params()
        moe = self.moe
        routed = moe.top_k if active_only else moe.num_experts
        router = self.hidden_size * moe.num_experts
        return router + (routed + moe.num_shared_experts) * self.expert_params()

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        """Every parameter: embeddings, blocks (two norms each), final norm, output head."""
        blocks = sum(self.attention_params() + self.mlp_params(i) + 2 * self.hidden_size
                     for i in range(self.num_layers))
        head = 0 if self.tie_embeddings else self.embedding_params()
        return self.embedding_params() + blocks + self.hidden_size + head

    def active_matmul_params(self) -> int:
        """Matmul weights one token passes through: blocks (top-k experts only) + output head.

        The embedding is a lookup, not a matmul, and norms are elementwise: neither counts.
        """
        blocks = sum(self.attention_params() + self.mlp_params(i, active_only=True)
                     for i in range(self.num_layers))
        return blocks + self.embedding_params()

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token, forward + backward, recompute not counted:

            6 * active matmul params + 12 * layers * heads * head_dim * seq_len

        The first term is 2 FLOPs per multiply-add, times 3 for forward + backward; the
        second is the attention scores and the weighted sum of values (PaLM's accounting,
        no discount for the causal mask).
        """
        attention = 12 * self.num_layers * self.num_heads * self.head_dim * self.seq_len
        return 6 * self.active_matmul_params() + attention


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
    dense = data.pop("dense_tflops", None) or {}
    if not isinstance(dense, dict):
        raise UsageError(f"dense_tflops: must be a mapping of precision: TFLOP/s, got {type(dense).__name__}")
    return dataclasses.replace(_build(HardwareConfig, data), dense_tflops=dict(dense)).validate()


# -- loading ---------------------------------------------------------------------------------

def trained_dtype(model: ModelConfig, device: str, dtype: str | None = None) -> str:
    """The precision a trial trains in: `--dtype`, else on CUDA the model's own, else fp32 (a
    CPU trial is the numerics oracle unless asked for the GPU's mixed-precision plan)."""
    if dtype is not None:
        return parse_dtype(dtype, "--dtype")
    return model.dtype if device == "cuda" else "fp32"


def as_trained(model: ModelConfig, device: str, dtype: str | None = None) -> ModelConfig:
    """The model with the precision it trains in (trained_dtype) as its dtype."""
    return dataclasses.replace(model, dtype=trained_dtype(model, device, dtype))


def model_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def hardware_presets() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_model(spec: str) -> ModelConfig:
    """A preset name, a YAML file, or a Hugging Face config.json."""
    path = _resolve(spec, PRESET_DIR, "model", model_presets())
    data = _read_mapping(path)
    if path.suffix == ".json":
        data = from_hf_config(data, name=path.parent.name or path.stem)
    elif "hf_config" in data:
        # A YAML that starts from a config.json and overrides the training shape.
        base_path = (path.parent / str(data.pop("hf_config"))).resolve()
        base = from_hf_config(_read_mapping(base_path), name=path.stem)
        data = {**base, **data}
    data.setdefault("name", path.stem)
    return model_from_dict(data)


def model_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    moe = data.pop("moe", None)
    if moe is not None:
        if not isinstance(moe, dict):
            raise UsageError(f"moe: must be a mapping, got {type(moe).__name__}")
        data["moe"] = _build(MoEConfig, moe, prefix="moe.")
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


# Hugging Face key names -> ours. Llama, Mistral, Mixtral, Qwen2, Qwen3 and Qwen3-MoE all
# use these names for the dense part; they differ only in how they describe experts.
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "ffn_hidden_size",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_embeddings",
}
HF_DEFAULT_SEQ_LEN = 4096
HF_DEFAULT_GLOBAL_BATCH = 256


def from_hf_config(hf: dict, name: str) -> dict:
    """Translate a Hugging Face config.json into our field names (a dict, validated later).

    A config.json describes the architecture, not the training run, so seq_len is the
    model's context capped at 4096 and global_batch_size 256; a YAML with `hf_config:`
    overrides both.
    """
    if "num_hidden_layers" not in hf or "hidden_size" not in hf:
        raise UsageError(f"{name}: not a Hugging Face model config (no num_hidden_layers/hidden_size)")
    out = {ours: hf[theirs] for theirs, ours in _HF_KEYS.items() if hf.get(theirs) is not None}
    out["name"] = name
    out["seq_len"] = min(int(hf.get("max_position_embeddings", HF_DEFAULT_SEQ_LEN)), HF_DEFAULT_SEQ_LEN)
    out["global_batch_size"] = HF_DEFAULT_GLOBAL_BATCH
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype")
    out["dtype"] = "fp32" if torch_dtype == "float32" else "bf16"
    num_layers = int(hf["num_hidden_layers"])
    if "num_local_experts" in hf:  # Mixtral: every layer is MoE, experts use intermediate_size
        out["moe"] = {
            "num_experts": hf["num_local_experts"],
            "top_k": hf.get("num_experts_per_tok", 2),
            "expert_ffn_hidden_size": hf["intermediate_size"],
            "aux_loss_weight": hf.get("router_aux_loss_coef", 0.01),
        }
    elif hf.get("num_experts") and "moe_intermediate_size" in hf:  # Qwen3-MoE (and Qwen2-MoE)
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        dense = set(hf.get("mlp_only_layers") or [])
        layers = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
        moe = {
            "num_experts": hf["num_experts"],
            "top_k": hf.get("num_experts_per_tok", 8),
            "expert_ffn_hidden_size": hf["moe_intermediate_size"],
            "aux_loss_weight": hf.get("router_aux_loss_coef", 0.001),
            "layers": "all" if len(layers) == num_layers else layers,
        }
        shared = hf.get("shared_expert_intermediate_size") or 0
        if shared:
            moe["num_shared_experts"] = max(1, shared // hf["moe_intermediate_size"])
        out["moe"] = moe
    return out


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
