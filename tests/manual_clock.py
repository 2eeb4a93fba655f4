"""A clock a test sets by hand: ``clock()`` returns ``clock.now``, so deadlines, expiries
and back-offs on an injectable clock are tested without sleeping."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
