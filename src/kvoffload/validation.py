"""Argument checks shared by every layer: each raises ``ValueError`` naming the argument
and the bad value, and returns the value when it is good. ``bool`` is not an int here."""

from __future__ import annotations


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int > 0."""
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


def non_negative_int(name: str, value: object, meaning: str = "") -> int:
    """``value`` if it is an int >= 0; ``meaning`` (e.g. ``"0 = unlimited"``) joins the message."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        note = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be a non-negative int{note}, got {value!r}")
    return value  # type: ignore[return-value]
