"""Reading a description file: a preset name or a path -> a mapping -> a dataclass whose
fields are checked by name and type, so every mistake is one line that names the field."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

import yaml

from autotune.errors import UsageError


def resolve_file(spec: str, preset_dir: Path, what: str, presets: list[str]) -> Path:
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise UsageError(f"{what}: no such file {spec}")
        return path
    preset = preset_dir / f"{spec}.yaml"
    if not preset.is_file():
        raise UsageError(f"{what}: unknown preset {spec!r} (presets: {', '.join(presets)})")
    return preset


def read_mapping(path: Path) -> dict:
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


def build(cls, data: dict, prefix: str = ""):
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
        data[name] = check_type(prefix + name, data[name], hints[name])
    return cls(**data)


def check_type(name: str, value, hint):
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


def positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{name}: must be a positive integer, got {value!r}")
