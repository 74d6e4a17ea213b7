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
    if bad := control_chars(text):
        # TOML would read only the first line of the value and drop the rest (a later ``seed=5``) without a word
        raise ConfigError(f"override {text!r}: holds control character(s) {bad}; give one KEY=VALUE per override")
    key, raw = (s.strip() for s in text.split("=", 1))
    if not key or any(not p.strip() for p in key.split(".")):
        raise ConfigError(f"override {text!r}: no key (or an empty part of one); write KEY=VALUE, e.g. seed=3")
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


def control_chars(text: str) -> str:
    """The control characters in ``text`` (C0, DEL, C1) as escapes, e.g. ``'\\n'``; '' when there are none."""
    found = dict.fromkeys(c for c in text if _CONTROL.match(c))
    return ", ".join(repr(c) for c in found)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


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
    if isinstance(v, str):  # a basic string, every control character escaped, so it reads back equal
        return '"' + _CONTROL.sub(_escape, v.replace("\\", "\\\\").replace('"', '\\"')) + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _ESCAPES.get(c, f"\\u{ord(c):04X}")
