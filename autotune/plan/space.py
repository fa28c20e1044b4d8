"""Search spaces: `search_spaces/*.yaml` -> the valid layouts of (model, GPUs, space).

A space file names the values each layout key may take and the study's options:

    description: small space for a CPU demo
    layout:
      tp: [1, 2]            # any key of a layout but dp (always derived from the GPUs)
      dp_shard: [dp, 8]     # "dp" means dp_shard = dp (no HSDP)
      ...
    options:
      max_comm_fraction: 0.30
      steps: 3
      warmup: 1

Keys left out take the layout defaults. Only valid layouts are ever searched: the
space is enumerated once and every sampler chooses among the valid layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from autotune.config import ModelConfig
from autotune.errors import UsageError
from autotune.plan.layout import INT_KEYS, STR_KEYS, Layout, enumerate_layouts

OPTION_TYPES: dict[str, type] = {"max_comm_fraction": float, "steps": int, "warmup": int}


@dataclass(frozen=True)
class Space:
    name: str
    values: dict[str, Any]  # layout key -> list of values
    options: dict[str, Any] = field(default_factory=dict[str, Any])
    description: str = ""


def space_names() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in resources.files("autotune.search_spaces").iterdir()
                  if p.name.endswith(".yaml"))


def load_space(spec: str) -> Space:
    """A path to a YAML file, or the name of a file in search_spaces/ (`quick`)."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UsageError(f"space: no such file {spec}")
        text, name = path.read_text(), path.stem
    else:
        resource = resources.files("autotune.search_spaces") / f"{spec}.yaml"
        if not resource.is_file():
            raise UsageError(f"space: unknown search space {spec!r} (known: {', '.join(space_names())})")
        text, name = resource.read_text(), spec
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise UsageError(f"space {name}: malformed YAML{f' at line {mark.line + 1}' if mark else ''}") from None
    return space_from_dict(data, name)


def space_from_dict(data: object, name: str) -> Space:
    if not isinstance(data, dict):
        raise UsageError(f"space {name}: must hold a mapping with a 'layout' section")
    unknown = set(data) - {"description", "layout", "options"}
    if unknown:
        raise UsageError(f"space.{sorted(unknown)[0]}: unknown section (known: description, layout, options)")
    layout = data.get("layout") or {}
    if not isinstance(layout, dict) or not layout:
        raise UsageError("space.layout: must be a mapping of layout keys to lists of values")
    values = {}
    for key, choices in layout.items():
        if key == "dp":
            raise UsageError("space.layout.dp: dp is derived from the GPU count; give dp_shard instead")
        if key not in INT_KEYS + STR_KEYS:
            raise UsageError(f"space.layout.{key}: unknown layout key (known: {', '.join(INT_KEYS + STR_KEYS)})")
        if not isinstance(choices, list):
            choices = [choices]
        if not choices:
            raise UsageError(f"space.layout.{key}: must list at least one value")
        for value in choices:
            ok = isinstance(value, str) if key in STR_KEYS else (
                (isinstance(value, int) and not isinstance(value, bool)) or (key == "dp_shard" and value == "dp"))
            if not ok:
                kind = "strings" if key in STR_KEYS else "integers" + (' or "dp"' if key == "dp_shard" else "")
                raise UsageError(f"space.layout.{key}: values must be {kind}, got {value!r}")
        values[key] = choices
    options = data.get("options") or {}
    if not isinstance(options, dict):
        raise UsageError("space.options: must be a mapping")
    for key, value in options.items():
        option_type = OPTION_TYPES.get(key)
        if option_type is None:
            raise UsageError(f"space.options.{key}: unknown option (known: {', '.join(OPTION_TYPES)})")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (option_type is int and not isinstance(value, int)):
            raise UsageError(f"space.options.{key}: must be a number, got {value!r}")
    return Space(name=name, values=values, options=options, description=str(data.get("description", "")))


def valid_layouts(model: ModelConfig, gpus: int, space: Space, gpus_per_node: int | None = None) -> list[Layout]:
    """Every valid layout of the space, in the space's nested order; an empty space is bad input."""
    layouts = enumerate_layouts(model, gpus, space.values, gpus_per_node)
    if not layouts:
        raise UsageError(f"space {space.name}: no valid layout for {model.name} on {gpus} GPUs "
                         f"(check the degrees against the layout rules: autotune trial --layout explains each)")
    return layouts
