"""YAML / `--set` -> frozen dataclasses. Unknown keys are errors that name the key; values are type-checked."""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from bertpipe.pipeline.framework import storage

_T = TypeVar("_T")
YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


class ConfigError(ValueError):
    """A user error in a config file or a `--set` override."""


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(annotation, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [arg for arg in args if arg is not type(None)]  # a value that is not None must be one of these
        for arg in kinds:
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                if len(kinds) == 1:  # `float | None`: the float's own reason (nan, inf, not a number)
                    raise
        raise ConfigError(f"{where}: {value!r} matches none of {annotation}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is tuple:
        items = [value] if isinstance(value, (str, int, float)) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        return tuple(_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(items))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_t, val_t = args if args else (Any, Any)
        return {_coerce(k, key_t, where): _coerce(v, val_t, f"{where}.{k}") for k, v in value.items()}
    if annotation is Any:
        return value
    return _coerce_scalar(value, annotation, where)


def _coerce_scalar(value: Any, annotation: Any, where: str) -> Any:
    """bool, int, float (finite) and str, strictly: YAML's 1 is no boolean and true no number."""
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML reads "1e-4" as a string
            except ValueError:
                pass
        # nan passes every `x < low` check and inf is no rate, size or probability: refused for every field at once.
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        hint = " (YAML reads bare on/off/yes/no as booleans: quote it)" if isinstance(value, bool) else ""
        raise ConfigError(f"{where}: expected a string, got {value!r}{hint}")
    return value


def from_dict(cls: type[_T], data: dict[str, Any], where: str = "") -> _T:
    """Build dataclass `cls` from a mapping; unknown keys raise ConfigError naming them."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        close = difflib.get_close_matches(str(unknown[0]), list(fields), n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else ""
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}{hint}"
            + (f" (also unknown: {unknown[1:]})" if len(unknown) > 1 else "")
            + f" (valid keys{' of ' + where if where else ''}: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def to_dict(obj: Any) -> Any:
    """Plain JSON/YAML-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], parsed c). Values are read as YAML scalars/lists (`x=[1,2]`, `y=true`)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    if raw.strip().lower() in YAML11_BOOL_WORDS:
        # YAML 1.1 reads on/off/yes/no as booleans; `mlflow.tracking_uri=off` means the string.
        return key.strip().split("."), raw.strip()
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    return data


def stable_hash(obj: Any) -> str:
    """sha256 of the canonical JSON form of `obj` (dataclasses allowed)."""
    blob = json.dumps(to_dict(obj), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def absolute(value: str, base: str) -> str:
    """A URI (s3://, gs://, https://, file://) or "" unchanged; a local path made absolute against `base`."""
    if not value or storage.is_remote(value):
        return value
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def resolve_paths(obj: _T, base: str) -> _T:
    """A copy of config `obj` whose every path field (`pipeline.framework.config_fields.path_field`, at any depth) is
    absolute or a URI.

    The one place relative paths are interpreted: on the driver, against the directory the user ran from.
    Nothing downstream (stages, Ray tasks, Train workers, whose working directory is Ray's) sees a relative path.
    """
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("path"):
            changes[f.name] = (tuple(absolute(v, base) for v in value) if isinstance(value, tuple)
                               else absolute(value, base))
        elif dataclasses.is_dataclass(value):
            changes[f.name] = resolve_paths(value, base)
    return dataclasses.replace(obj, **changes)
