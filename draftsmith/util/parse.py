"""Config parsing every package may use (a leaf: imports nothing from draftsmith but its error):
dataclass <- dict with typed checks, `key=value` overrides, YAML in and out.

Unknown keys are errors that name the key and the closest valid one (as SpecForge's
`extra="forbid"` and torchtune's config checks do).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from draftsmith import DraftsmithError


def _unknown_key(key: str, valid: list[str], where: str) -> DraftsmithError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return DraftsmithError(f"{where}: unknown key '{key}'{hint}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert one YAML value against a dataclass field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DraftsmithError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (bool, int, float)):
        return str(value).lower() if isinstance(value, bool) else str(value)
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    check = origin or tp
    if check is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads `3e-4` as a string
        except ValueError:
            pass
    if not isinstance(value, check) or (check is int and isinstance(value, bool)):
        raise DraftsmithError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def from_dict(cls: type, data: dict, where: str = "config") -> Any:
    """Build dataclass `cls` from a dict; unknown keys and wrong types raise DraftsmithError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(key, names, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def parse_overrides(overrides: list[str]) -> dict:
    """`["optim.lr=1e-4", "drafter.noise=0"]` -> nested dict; values are parsed as YAML scalars."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise DraftsmithError(f"override '{item}': expected key=value, e.g. optim.lr=1e-4")
        key, raw = item.split("=", 1)
        node = nested
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DraftsmithError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{path}: expected a mapping of config keys at the top level")
    return data


def save_yaml(data: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
