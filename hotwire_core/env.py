"""How hotwire reads its environment: one parser per kind of value (bounded ints and floats, yes/no flags, text,
one of a few words, a layer list), and ``setting`` to declare a dataclass field as the variable that sets it, with
its default, bounds and doc in one place. ``load`` builds such a dataclass from the environment; adding a setting
is one field. Values are checked when read, so a bad one stops the process at start with a message naming it."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Choice", "Flag", "Float", "Int", "Layers", "MAX_LAYER", "Parsed", "Text", "Var", "load", "parse_layers",
           "setting", "variables"]

_T = TypeVar("_T")
_ENV = "hotwire_env"  # a dataclass field's metadata key: the Var that sets it


@dataclass(frozen=True)
class Var:
    """One environment variable: ``name``, the value when it is unset or empty (``default``), what it sets
    (``doc``), and ``to``, which turns the parsed value into the field's (megabytes into bytes)."""

    name: str
    _: dataclasses.KW_ONLY
    default: Any = None
    doc: str
    to: Callable[[Any], Any] | None = None

    def read(self, env: Mapping[str, str] = os.environ) -> Any:
        raw = env.get(self.name, "")
        value = self.default if not raw.strip() else self.parse(raw)
        return value if self.to is None or value is None else self.to(value)

    def parse(self, raw: str) -> Any:
        """A set, non-empty value; each kind below reads its own."""
        raise NotImplementedError

    @property
    def value_default(self) -> Any:
        return self.default if self.to is None or self.default is None else self.to(self.default)


@dataclass(frozen=True, kw_only=True)
class Int(Var):
    lo: int = 0
    hi: int = 1 << 62

    def parse(self, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not an integer") from None
        if not self.lo <= value <= self.hi:
            raise ValueError(f"{self.name}={value} must be in [{self.lo}, {self.hi}]")
        return value


@dataclass(frozen=True, kw_only=True)
class Float(Var):
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    lo: float = 0.0
    hi: float = math.inf
    lo_open: bool = False

    def parse(self, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not (math.isfinite(value) and low_ok and value <= self.hi):
            above = f"above {self.lo:g}" if self.lo_open else f"from {self.lo:g}"
            bound = above if self.hi == math.inf else f"{above} to {self.hi:g}"
            raise ValueError(f"{self.name} must be a number {bound}, got {raw!r}")
        return value


_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True, kw_only=True)
class Flag(Var):
    """Yes or no: 1/true/yes/on or 0/false/no/off in any case. Anything else is an error, not a silent "off"."""

    def parse(self, raw: str) -> bool:
        word = raw.strip().lower()
        if word in _YES or word in _NO:
            return word in _YES
        raise ValueError(f"{self.name}={raw!r} must be 1 or 0 (true/false, yes/no and on/off work too)")


@dataclass(frozen=True, kw_only=True)
class Text(Var):
    """Any text, as given; unset or empty: ``default`` (None)."""

    def parse(self, raw: str) -> str:
        return raw


@dataclass(frozen=True, kw_only=True)
class Choice(Var):
    """One of ``options``; set but empty is an error too (it names none of them)."""

    options: tuple[str, ...] = ()

    def read(self, env: Mapping[str, str] = os.environ) -> str:
        return self.parse(env.get(self.name, self.default))

    def parse(self, raw: str) -> str:
        if raw not in self.options:
            raise ValueError(f"{self.name}={raw!r} must be {' or '.join(repr(o) for o in self.options)}")
        return raw


@dataclass(frozen=True, kw_only=True)
class Parsed(Var):
    """A value with a parser of its own (``parse_with(raw)``, which raises ValueError naming the variable)."""

    parse_with: Callable[[str], Any] = str

    def parse(self, raw: str) -> Any:
        return self.parse_with(raw)


MAX_LAYER = 1 << 16  # far above any model's depth; bounds layer ranges before they are expanded


def parse_layers(text: str, name: str = "HOTWIRE_LAYERS") -> frozenset[int]:
    """``"8-20,24"`` -> {8, ..., 20, 24}: comma-separated layer indices and inclusive ranges."""
    layers: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise ValueError(f"{name}={text!r}: {part.strip()!r} is not a layer index or a range like 8-20") from None
        if lo < 0 or hi < lo or hi >= MAX_LAYER:
            raise ValueError(f"{name}={text!r}: {part.strip()!r} is not a range of layers in [0, {MAX_LAYER})")
        layers.update(range(lo, hi + 1))
    return frozenset(layers)


@dataclass(frozen=True, kw_only=True)
class Layers(Var):
    """Layer indices and ranges (``8-20,24``); unset or empty: ``default`` (None, every layer)."""

    def parse(self, raw: str) -> frozenset[int]:
        return parse_layers(raw, self.name)


def setting(var: Var, **field: Any) -> Any:
    """A dataclass field that ``var`` sets (its default: ``var``'s); ``field``: more of ``dataclasses.field``'s
    arguments (``repr=False`` for a secret)."""
    return dataclasses.field(default=var.value_default, metadata={_ENV: var}, **field)


def variables(cls: type) -> dict[str, Var]:
    """Field name -> the variable that sets it, for every ``setting`` field of ``cls``."""
    return {f.name: f.metadata[_ENV] for f in dataclasses.fields(cls) if _ENV in f.metadata}


def load(cls: type[_T], env: Mapping[str, str] = os.environ, **values: Any) -> _T:
    """``cls`` with every ``setting`` field read from ``env``; ``values``: the other fields."""
    return cls(**{name: var.read(env) for name, var in variables(cls).items()}, **values)
