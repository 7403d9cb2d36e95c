"""Updates of a tree of frozen dataclasses from a YAML mapping or ``--set key=value`` pairs.

Owns: parsing ``section.field=value`` pairs into a nested mapping (``parse_overrides``),
applying a mapping to the tree (``apply_updates``): each value coerced to its field's
annotation (bool/int/float/str, ``X | None``, ``Literal``; numbers finite), mapping fields merged, an
unknown key refused with the close match suggested — every failure one
:class:`~colocate.errors.ConfigError` line. Leaves out: which fields exist and what values
are valid together (``colocate.config``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

import yaml

from colocate.errors import ConfigError


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """``value`` converted to ``annotation`` (str → int/float/bool where needed)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not a {annotation}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    return _coerce_scalar(value, annotation, key)


def _coerce_scalar(value: Any, annotation: Any, key: str) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            num = annotation(value) if annotation is float or isinstance(value, (int, str)) else None
        except (TypeError, ValueError):
            num = None
        if num is None or (annotation is int and isinstance(value, float) and value != int(value)):
            raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
        if not math.isfinite(num):  # no field means anything by NaN or ±inf (a NaN learning rate trains NaN)
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return num
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def _unknown(key: str, known: list[str]) -> ConfigError:
    prefix, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, known, n=1)
    where = f"{prefix}." if prefix else ""
    hint = f"; did you mean '{where}{close[0]}'?" if close else f"; known: {', '.join(known)}"
    return ConfigError(f"unknown config key '{key}'{hint}")


def apply_updates(obj: Any, *updates: dict[str, Any], prefix: str = "") -> Any:
    """The frozen dataclass ``obj`` with ``updates`` (nested mappings, later ones winning:
    a file, then ``--set`` pairs) applied, each value coerced to its field's type; an
    unknown key suggests the close match. Each nested dataclass is built once, from every
    mapping's values for it, so its own checks (``__post_init__``) see its final values."""
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    changes: dict[str, Any] = {}
    nested: dict[str, list[dict[str, Any]]] = {}  # a dataclass field -> its mappings, in order
    for mapping in updates:
        if not isinstance(mapping, dict):
            raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {mapping!r}")
        for name, value in mapping.items():
            key = f"{prefix}{name}"
            if name not in fields:
                raise _unknown(key, list(fields))
            current = getattr(obj, name)
            if dataclasses.is_dataclass(current):
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a mapping, got {value!r}")
                nested.setdefault(name, []).append(value)
            elif typing.get_origin(hints[name]) is dict:
                changes[name] = _merge(changes.get(name, current), value, key)
            else:
                changes[name] = _coerce(value, hints[name], key)
    for name, mappings in nested.items():
        changes[name] = apply_updates(getattr(obj, name), *mappings, prefix=f"{prefix}{name}.")
    return dataclasses.replace(obj, **changes)


def _merge(current: dict[str, Any], value: Any, key: str) -> dict[str, Any]:
    """A mapping field: ``value``'s entries over ``current``'s (a YAML mapping, several ``--set key.name=...``)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping (e.g. --set {key}.<name>=<value>), got {value!r}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{key}: names must be strings, got {bad[0]!r}")
    return {**current, **value}


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["ppo.epochs=2", "run.steps=5"]`` → nested dict of strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected section.field=value")
        key, value = pair.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        parsed = yaml.safe_load(value) if value.strip() else ""
        old = node.get(parts[-1])  # a mapping given twice (engines.sglang) merges, left to right
        node[parts[-1]] = {**old, **parsed} if isinstance(old, dict) and isinstance(parsed, dict) else parsed
    return out


def names(text: str) -> tuple[str, ...]:
    """A comma list's entries, stripped, empty ones dropped ("a, b,," -> ("a", "b"))."""
    return tuple(x.strip() for x in text.split(",") if x.strip())
