"""Counter sets: one pattern for every component that counts.

A component keeps one mutable instance of its ``Counters`` subclass (int fields with
defaults, incremented in place by their owner, under the component's lock where several
threads write) and hands out ``snapshot()`` copies, which later counting does not change.
``as_dict()`` is the flat form the CLI prints and metrics export.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cache
from typing import Any, Self


@dataclass
class Counters:
    def snapshot(self, **overrides: Any) -> Self:
        """A copy, with ``overrides`` for fields the owner derives at read time."""
        return replace(self, **overrides)

    def as_dict(self) -> dict[str, int]:
        # The fields are ints, so a flat copy is a deep one; ``dataclasses.asdict`` deep-
        # copies value by value, and vLLM's engine asks for these counters every step.
        return {name: getattr(self, name) for name in _field_names(type(self))}


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))
