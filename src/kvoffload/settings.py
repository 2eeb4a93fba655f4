"""Configuration schemas: every key an owner takes (the vLLM connector's extra config, one
secondary tier type's entry) is declared once, in one table, and checked by one validator.

* ``Key(name, kind, default, meaning)``: ``kind`` is a ``Kind`` (what values it takes and
  how errors and README say so); ``default`` is the value when the key is absent
  (``REQUIRED``: it must be given; ``None``: absent means "not set"); ``meaning`` is the one
  line README's tables show (Markdown).
* ``Schema(keys, where=..., unknown=..., missing=...)``: an owner's table and how its errors
  name a key. ``Schema.parse(options)`` returns every key's value, defaults filled in, or
  raises a ``ValueError`` naming the key and the bad value: ``"{where} must {kind.must},
  got {value!r}"``. Rules over several keys stay as code next to the table that owns them.
* ``Schema.markdown(header)``: the table as README shows it (``scripts/config_tables.py``
  writes README's key tables from the schemas; a test checks they agree).

Parsing has no side effects: a kind checks values only, it touches no file, socket or
environment variable (a tier does that when it is built).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Kind:
    """The values a key takes. ``shown``: how README's tables say it; ``must``: the error's
    words (``"<key> must <must>, got <value>"``); ``check(value)`` is true for a good value,
    ``convert`` normalises one (e.g. to ``float``). A kind with ``parse(where, value)``
    does its own checks and messages instead (a nested structure, an import path)."""

    shown: str
    must: str = ""
    check: Callable[[Any], bool] | None = None
    convert: Callable[[Any], Any] | None = None
    parse: Callable[[str, Any], Any] | None = None

    def __call__(self, where: str, value: Any) -> Any:
        if self.parse is not None:
            return self.parse(where, value)
        if self.check is not None and not self.check(value):
            raise ValueError(f"{where} must {self.must}, got {value!r}")
        return value if self.convert is None else self.convert(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


POSITIVE_INT = Kind("int > 0", "be a positive int", lambda v: _is_int(v) and v > 0)
NON_NEGATIVE_INT = Kind("int ≥ 0", "be a non-negative int", lambda v: _is_int(v) and v >= 0)
BOOL = Kind("`true` / `false`", "be true or false", lambda v: isinstance(v, bool))
POSITIVE_SECONDS = Kind(
    "seconds > 0", "be a positive number of seconds", lambda v: _is_number(v) and v > 0, float
)
FRACTION = Kind("number in [0, 1)", "be a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1, float)
PATH = Kind(
    "path",
    "be a path",
    lambda v: isinstance(v, (str, os.PathLike)) and bool(os.fspath(v)),
    os.fspath,
)


def seconds(low: float, high: float) -> Kind:
    """A number of seconds in ``[low, high]``."""
    bounds = f"[{low:g}, {high:g}]"
    return Kind(
        f"seconds in {bounds}", f"be seconds in {bounds}", lambda v: _is_number(v) and low <= v <= high, float
    )


def one_of(*values: Any, must: str = "") -> Kind:
    """One of ``values`` (``True`` is not ``1`` here)."""

    def good(value: Any) -> bool:
        return any(type(value) is type(v) and value == v for v in values)

    shown = " / ".join(f"`{_literal(v)}`" for v in values)
    return Kind(shown, must or f"be one of {list(values)}", good)


def text(shown: str, must: str, good: Callable[[str], bool]) -> Kind:
    """A string ``good`` accepts."""
    return Kind(shown, must, lambda v: isinstance(v, str) and good(v))


def custom(shown: str, parse: Callable[[str, Any], Any]) -> Kind:
    """A kind with its own checks and messages: ``parse(where, value)`` returns the value."""
    return Kind(shown, parse=parse)


@dataclass(frozen=True)
class Key:
    """One configuration key (see the module docstring). ``shown_default`` replaces the
    default in README when the value alone does not say it (``"the engine's"``); ``hint``
    joins the error for a missing required key."""

    name: str
    kind: Kind
    default: Any
    meaning: str
    shown_default: str = ""
    hint: str = ""

    def default_text(self) -> str:
        if self.shown_default:
            return self.shown_default
        if self.default is REQUIRED:
            return "required"
        if self.default is None:
            return "—"
        return f"`{_literal(self.default)}`"


@dataclass(frozen=True)
class Schema:
    """An owner's keys. Message templates: ``where`` names a key (``{key}``); ``unknown``
    lists unknown keys (``{unknown}``, ``{known}``); ``missing`` a required one absent
    (``{where}``, ``{key}``, ``{hint}``: the key's hint in parentheses, or nothing)."""

    keys: tuple[Key, ...]
    where: str = "{key}"
    unknown: str = "unknown key(s) {unknown}; known: {known}"
    missing: str = "{where} is required{hint}"

    def __post_init__(self) -> None:
        if len(self.names) != len(self.keys):
            raise ValueError(f"a key is declared twice in {self.names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(key.name for key in self.keys))

    def parse(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Every key's value (absent ones at their default), each checked by its kind."""
        unknown = sorted(str(k) for k in set(options) - set(self.names))
        if unknown:
            raise ValueError(self.unknown.format(unknown=unknown, known=list(self.names)))
        values = {}
        for key in self.keys:
            where = self.where.format(key=key.name)
            if key.name in options:
                values[key.name] = key.kind(where, options[key.name])
            elif key.default is REQUIRED:
                hint = f" ({key.hint})" if key.hint else ""
                raise ValueError(self.missing.format(where=where, key=key.name, hint=hint))
            else:
                values[key.name] = key.default
        return values

    def markdown(self, header: str) -> str:
        """README's table of these keys; ``header`` heads the key column."""
        lines = [f"| {header} | value | default | meaning |", "|---|---|---|---|"]
        for key in self.keys:
            cells = (f"`{key.name}`", key.kind.shown, key.default_text(), key.meaning)
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        return "\n".join(lines) + "\n"


def _literal(value: Any) -> str:
    """``value`` as a JSON config writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
