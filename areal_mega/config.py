"""Typed configuration: nested dataclasses loaded from YAML, with dotted command-line overrides.

    cfg = load_config(ExperimentConfig, "configs/grpo_tiny.yaml", ["actor.optimizer.lr=1e-6"])

Each component owns the dataclass of the settings it reads (one docstring per field, written as
a string literal right under the field, the convention torchtitan uses). This module only knows
how to turn YAML into those dataclasses:

* an unknown key, a value of the wrong type, or a value a dataclass's ``validate()`` rejects
  raises :class:`ConfigError` naming the dotted key and the file it came from;
* overrides are ``dotted.key=value`` where ``value`` is parsed as YAML (so ``1e-6``, ``true``,
  ``[1, 2]`` and ``null`` mean what they look like).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from areal_mega.errors import UserError
from areal_mega.kinds import OPTIONS_OF, KindError, options_type, resolve

__all__ = [
    "ConfigError", "T", "check_each", "dump_yaml", "from_dict", "load_config", "load_dict", "parse_overrides", "to_dict",
    "validate_tree", "yaml_error_line"
]

T = TypeVar("T")


class ConfigError(UserError):
    """A user-facing configuration error; the message names the key (and file)."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert where lossless (int -> float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # an optional X: X's own error is the precise one
            raise ConfigError(errors[0])
        raise ConfigError(f"{where}{key}: {value!r} is not a valid {_type_name(tp)} ({'; '.join(errors)})")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and ("off" if not value else "on") in allowed:
            return "off" if not value else "on"  # YAML 1.1 reads a bare off/on (and false/true) as a bool
        if value not in allowed:
            raise ConfigError(f"{where}{key}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}{key}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}{key}: expected a mapping, got {value!r}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: _coerce(v, val_tp, f"{key}.{k}", where) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, key + ".", where)
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-6" (no dot) as a string; accept what float() reads as a number.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}{key}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}{key}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}{key}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}{key}: expected {tp.__name__}, got {value!r}")
    return value


def _build(cls: type[T], data: dict, prefix: str, where: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in data:
        if k not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{where}unknown key '{prefix}{k}' (known keys here: {known})")
    kwargs = {k: _coerce(v, hints[k], prefix + k, where) for k, v in data.items()}
    for kind_key, family in getattr(cls, "OPEN_KINDS", {}).items():
        options_key = OPTIONS_OF[kind_key]
        kwargs[options_key] = _open_kind_options(fields, kwargs, kind_key, family, options_key, prefix, where)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field without a default is missing
        raise ConfigError(f"{where}{prefix.rstrip('.') or cls.__name__}: {e}") from None
    return obj


def _open_kind_options(fields: dict, kwargs: dict, kind_key: str, family: str, options_key: str, prefix: str,
                       where: str) -> Any:
    """The typed options of the kind ``kwargs[kind_key]`` names (``areal_mega.kinds``): its
    ``Options`` dataclass built from the section's ``options_key`` with the usual checks."""
    kind = kwargs.get(kind_key, fields[kind_key].default)
    try:
        opts_cls = options_type(resolve(family, kind))
    except KindError as e:
        raise ConfigError(f"{where}{prefix}{kind_key}: {e}") from None
    raw = kwargs.get(options_key)
    if opts_cls is None:
        if raw:
            raise ConfigError(f"{where}{prefix}{options_key}: {family} {kind!r} takes no options (it declares no "
                              f"Options dataclass)")
        return None
    if isinstance(raw, opts_cls):
        return raw
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{where}{prefix}{options_key}: expected a mapping for {opts_cls.__name__}, got {raw!r}")
    return _build(opts_cls, raw or {}, f"{prefix}{options_key}.", where)


def check_each(key: str, items: list, check: str = "validate") -> None:
    """``item.<check>()`` for every item of the list at ``key``; an error names ``key[i].``."""
    for i, item in enumerate(items):
        try:
            getattr(item, check)()
        except ValueError as e:
            raise ValueError(f"{key}[{i}].{e}") from None


def validate_tree(obj: Any, prefix: str = "", where: str = "", *, depth: int = 0) -> None:
    """Call ``validate()`` on every nested dataclass, turning ValueError into ConfigError
    (``depth``: only on those at least that deep, 0 = ``obj`` itself)."""
    for f in dataclasses.fields(obj):
        child = getattr(obj, f.name)
        if dataclasses.is_dataclass(child):
            validate_tree(child, f"{prefix}{f.name}.", where, depth=max(0, depth - 1))
    check = getattr(obj, "validate", None) if depth == 0 else None
    if check is not None:
        try:
            check()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{where}{prefix}{e}") from None


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: '{p}' is not a section")
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> dict:
    data: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), _override_value(key.strip(), raw))
    return data


def _override_value(key: str, raw: str) -> Any:
    """An override's value, read as YAML (``[a, b]``, ``1e-6``, ``null``); a plain scalar YAML
    parses but cannot build (``=``, ``<<``: YAML's value/merge tags) is the string itself."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.constructor.ConstructorError:
        return raw
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: {raw!r} is not valid YAML: {yaml_error_line(e)} "
                          "(quote it: key='\"...\"')") from None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    for kind_key, options_key in OPTIONS_OF.items():  # another kind: the old kind's options do not apply
        if kind_key in extra and extra[kind_key] != base.get(kind_key, extra[kind_key]):
            out.pop(options_key, None)
            if options_key in extra:
                out[options_key] = extra[options_key]
    return out


def from_dict(cls: type[T], data: dict, where: str = "", prefix: str = "", *, depth: int = 0) -> T:
    """Build and validate ``cls`` from a plain dict (``where`` prefixes error messages;
    ``prefix`` is the dotted key of ``data`` in a larger file, e.g. ``"launch."``; ``depth``:
    run ``validate()`` only on the dataclasses nested at least that deep, see validate_tree)."""
    obj = _build(cls, data or {}, prefix, where)
    validate_tree(obj, prefix, where, depth=depth)
    return obj


def yaml_error_line(e: yaml.YAMLError) -> str:
    """A YAML parse error on one line: what is wrong and where (PyYAML's message spans lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def load_dict(path: str | Path | None = None, overrides: list[str] | None = None, *,
              _seen: tuple = ()) -> tuple[dict, str]:
    """YAML file (optional) + dotted overrides -> (plain dict, error-message prefix). A file's
    top-level ``base: other.yaml`` loads that file first and this one's keys over it."""
    data: dict = {}
    where = ""
    if path is not None:
        where = f"{path}: "
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {yaml_error_line(e)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded or {}
        if "base" in data:  # this file's keys over another's (relative to this file's folder)
            base = Path(path).parent / str(data.pop("base"))
            if any(base.resolve() == Path(p).resolve() for p in (*_seen, path)):
                raise ConfigError(f"{path}: base: {base} makes a cycle of base files")
            data = _merge(load_dict(base, _seen=(*_seen, path))[0], data)
    if overrides:
        data = _merge(data, parse_overrides(overrides))
        where = f"{path or 'command line'} (with overrides): "
    return data, where


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + dotted overrides -> validated ``cls`` instance."""
    data, where = load_dict(path, overrides)
    return from_dict(cls, data, where)


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)
