"""TOML in and out: reading a config file, ``key=value`` overrides, merging tables, writing a resolved config."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from hafedho.core.algorithm import ConfigError


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p} is a folder, not a TOML file" if p.is_dir() else f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8-sig"))  # a byte-order mark (some editors) is no statement
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def is_number(value: Any) -> bool:
    """A TOML number: an int or a float, never a bool (which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, tables merged key by key (neither is changed)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``a.b=value`` -> ``{"a": {"b": value}}``; the value is read as TOML, else taken as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. algorithm.mu=0.01")
    key, raw = (s.strip() for s in text.split("=", 1))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def dump_toml(d: dict[str, Any]) -> str:
    """A minimal TOML writer for resolved configs (tables, strings, numbers, bools, lists)."""
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{_key(k)} = {_toml_value(v)}")
    out = "\n".join(lines)
    for name, t in tables:
        inner = {k: v for k, v in t.items() if not isinstance(v, dict)}
        out += f"\n\n[{_key(name)}]\n" + "\n".join(f"{_key(k)} = {_toml_value(v)}" for k, v in inner.items())
        for sub, st in ((k, v) for k, v in t.items() if isinstance(v, dict)):
            out += f"\n\n[{_key(name)}.{_key(sub)}]\n"
            out += "\n".join(f"{_key(k)} = {_toml_value(v)}" for k, v in st.items())
    return out.strip() + "\n"


def _key(k: str) -> str:
    """A key as TOML writes it: bare when it may be (letters, digits, ``_``, ``-``), else quoted (a user algorithm's
    table, ``[algorithm."my_pkg.mod:Alg"]``, whose dots would otherwise read as nested tables)."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
