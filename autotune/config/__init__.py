"""What the user describes: the model (a YAML file, a Hugging Face config.json or a preset),
the hardware it trains on, and the precision it trains in. Pure Python, no torch.

The names below are the package's public API; each is defined in one of its modules.
"""

from autotune.config.dtypes import DTYPES, GRAD_DTYPES, compute_dtype_name, parse_dtype, parse_grad_dtype
from autotune.config.hardware import (
    HARDWARE_DIR,
    HardwareConfig,
    hardware_for_device_name,
    hardware_from_dict,
    hardware_presets,
    load_hardware,
)
from autotune.config.model import (
    PRESET_DIR,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    as_trained,
    load_model,
    model_from_dict,
    model_presets,
    per_model_object,
    trained_dtype,
    trained_grad_dtype,
)
from autotune.config.units import GIB, human_bytes

__all__ = [
    "DTYPES", "GIB", "GRAD_DTYPES", "HARDWARE_DIR", "PRESET_DIR", "HardwareConfig", "MLAConfig", "ModelConfig",
    "MoEConfig", "as_trained", "compute_dtype_name", "hardware_for_device_name", "hardware_from_dict",
    "hardware_presets", "human_bytes", "load_hardware", "load_model", "model_from_dict", "model_presets",
    "parse_dtype", "parse_grad_dtype", "per_model_object", "trained_dtype", "trained_grad_dtype",
]
