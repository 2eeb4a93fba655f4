"""``CircuitBreaker``: stop talking to a server that does not answer, and try again later.

Closed (normal) until a call fails; then open: ``allow()`` is false (callers answer misses
and drop stores at once, without touching the network) until a retry time, when one call
is let through (half-open). Its success closes the breaker; its failure reopens it with
the delay doubled, capped at ``max_delay`` seconds, so the tier notices a recovered server
within ``max_delay``. Each transition is logged once (outage, recovery), never once per
call, and counted. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvoffload.tiers.redis.client import redact

log = logging.getLogger("kvoffload.tiers.redis")


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        base_delay: float = 0.5,
        max_delay: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < base_delay <= max_delay:
            raise ValueError(f"need 0 < base_delay <= max_delay, got {base_delay!r}, {max_delay!r}")
        self.name = name
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._clock = clock
        self._lock = threading.Lock()
        self._open_since: float | None = None
        self._retry_at = 0.0
        self._delay = base_delay
        self._trying = False
        self.outages = 0
        self.recoveries = 0

    @property
    def is_open(self) -> bool:
        return self._open_since is not None

    def allow(self) -> bool:
        """Whether a call may go to the server now."""
        if self._open_since is None:
            return True
        with self._lock:
            if self._open_since is None:
                return True
            if self._trying or self._clock() < self._retry_at:
                return False
            self._trying = True  # half-open: this caller probes the server
            return True

    def success(self) -> None:
        if self._open_since is None:
            return
        with self._lock:
            if self._open_since is None:
                return
            down = self._clock() - self._open_since
            self._open_since = None
            self._delay = self.base_delay
            self._trying = False
            self.recoveries += 1
        log.warning("%s: server answers again after %.1f s; the tier serves again", self.name, down)

    def failure(self, error: BaseException | str) -> None:
        with self._lock:
            now = self._clock()
            opened = self._open_since is None
            if opened:
                self._open_since = now
                self._delay = self.base_delay
                self.outages += 1
            else:
                self._delay = min(self._delay * 2, self.max_delay)
            self._retry_at = now + self._delay
            self._trying = False
        if opened:
            log.warning(
                "%s: server unavailable (%s); lookups miss and stores are dropped until it answers",
                self.name,
                redact(str(error)),
            )
