"""``MooncakeStore``: the one owner of a Mooncake Store client; every call goes through it.

Mooncake's Python client (``mooncake.store.MooncakeDistributedStore``, 0.3.13) reports
errors as negative return codes, never exceptions, and crashes the process when it is used
after ``close()``. This object makes the second impossible by construction: the native
client is private, each call enters under a lock that refuses once ``close`` began
(``StoreClosed``, naming the store), and ``close`` waits for the calls inside to leave
before it closes the native client.

Setup. ``setup`` of the native client against an unreachable master retries for about 90 s
before it fails, so the client is set up on a background thread, after a TCP connect to
the master's address answers (bounded by ``connect_timeout``), and again after each
failure, every ``retry`` seconds. Until it is up the store is ``down`` and every call
returns ``None`` at once. Buffers registered before that are registered once it is up.

Outages. With the master dead, an existence check answers ``-900`` at once while a get or
a put takes about 4.3 s (Mooncake's own RPC retries, not configurable in 0.3.13) before
answering ``-900``. Each call's codes go to a ``CircuitBreaker``: an outage code
(``OUTAGE_CODES``) opens it, and while it is open calls return ``None`` without touching
the client, but for one now and then that notices the master's return.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.tiers.redis.breaker import CircuitBreaker

log = logging.getLogger("kvoffload.tiers.mooncake")

RPC_FAIL = -900  # the master did not answer
OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200  # the store is full
INVALID_PARAMS = -600  # e.g. a buffer smaller than the object
TRANSFER_FAIL = -800  # the bytes did not move (also: buffers larger than the object)


def is_outage(code: int) -> bool:
    """Whether a return code says the master is unreachable (RPC failure, or one of the
    ``-1000`` and below codes of an unavailable high-availability master)."""
    return code == RPC_FAIL or code <= -1000


class StoreClosed(RuntimeError):
    """A call on a ``MooncakeStore`` after its ``close()``."""


@dataclass(frozen=True)
class ClientSettings:
    """What a native client is set up with (``MooncakeDistributedStore.setup``)."""

    master: str  # host:port of mooncake_master
    metadata_server: str  # "P2PHANDSHAKE" or "http://host:port/metadata"
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 0  # memory this process contributes to the store
    local_buffer_bytes: int = 16 << 20
    connect_timeout: float = 1.0

    def master_reachable(self) -> bool:
        host, _, port = self.master.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=self.connect_timeout):
                return True
        except OSError:
            return False


class MooncakeStore:
    def __init__(self, settings: ClientSettings, name: str, *, retry: float = 2.0, max_delay: float = 10.0):
        from kvoffload.extras import require

        require("mooncake.store", "mooncake", "the mooncake tier")
        self.settings = settings
        self.name = name
        self.breaker = CircuitBreaker(name, base_delay=min(0.5, max_delay), max_delay=max_delay)
        self._retry = retry
        self._cond = threading.Condition()
        self._native: Any = None
        self._closed = False
        self._active = 0  # calls inside the native client
        self._buffers: dict[int, int] = {}  # ptr -> bytes, registered or to register
        self._stop = threading.Event()
        self._setup_thread = threading.Thread(target=self._connect_loop, name="kvoffload-mooncake-setup",
                                              daemon=True)  # fmt: skip
        self._setup_thread.start()

    # -- setup ---------------------------------------------------------------------------

    def _connect_loop(self) -> None:
        warned = False
        while not self._stop.is_set():
            if self.settings.master_reachable() and self._setup_once():
                return
            if not warned:
                log.warning("%s: master %s unreachable; the tier misses until it answers", self.name,
                            self.settings.master)  # fmt: skip
                warned = True
            self._stop.wait(self._retry)

    def _setup_once(self) -> bool:
        from mooncake.store import MooncakeDistributedStore

        s = self.settings
        native = MooncakeDistributedStore()
        rc = native.setup(s.local_hostname, s.metadata_server, s.segment_bytes, s.local_buffer_bytes,
                          s.protocol, s.rdma_devices, s.master)  # fmt: skip
        if rc != 0:
            log.warning("%s: setup against master %s returned %s; retrying", self.name, s.master, rc)
            with contextlib.suppress(Exception):
                native.close()
            return False
        with self._cond:
            if self._closed:
                native.close()
                return True
            for ptr, size in self._buffers.items():
                code = native.register_buffer(ptr, size)
                if code != 0:
                    log.warning("%s: register_buffer(%#x, %d) returned %s", self.name, ptr, size, code)
            self._native = native
        log.info("%s: connected to master %s", self.name, s.master)
        return True

    def wait_ready(self, timeout: float) -> bool:
        """Whether the client is set up within ``timeout`` seconds (for tests and tools)."""
        self._setup_thread.join(timeout)
        return self._native is not None

    @property
    def ready(self) -> bool:
        return self._native is not None

    @property
    def down(self) -> bool:
        """Calls would return ``None`` now: not set up yet, or the breaker is open."""
        return self._native is None or self.breaker.is_open

    @property
    def closed(self) -> bool:
        return self._closed

    # -- calls ---------------------------------------------------------------------------

    def call(self, method: str, *args: Any) -> Any:
        """``native.<method>(*args)``; ``None`` when the store is down (not set up, or the
        breaker refuses); ``StoreClosed`` after ``close``. Return codes go to the breaker:
        an int or a list of ints (a negative one an error, an outage code opens it)."""
        with self._cond:
            if self._closed:
                raise StoreClosed(f"{self.name}: the Mooncake client is closed; {method} refused")
            native = self._native
            if native is None or not self.breaker.allow():
                return None
            self._active += 1
        try:
            result = getattr(native, method)(*args)
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()
        codes = result if isinstance(result, list) else [result] if isinstance(result, int) else []
        outage = next((c for c in codes if isinstance(c, int) and is_outage(c)), None)
        if outage is not None:
            self.breaker.failure(f"{method} returned {outage}")
        else:
            self.breaker.success()
        return result

    def register(self, ptr: int, size: int) -> None:
        """Register ``size`` bytes at ``ptr`` for zero-copy puts and gets (now if set up,
        else once it is); the memory must outlive this store."""
        with self._cond:
            if self._closed:
                raise StoreClosed(f"{self.name}: the Mooncake client is closed; register refused")
            self._buffers[ptr] = size
            native = self._native
            if native is not None:
                code = native.register_buffer(ptr, size)
                if code != 0:
                    raise RuntimeError(f"{self.name}: register_buffer({ptr:#x}, {size}) returned {code}")

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new calls, wait for those inside (each bounded by Mooncake's own RPC
        timeouts), unregister the buffers and close the client. Idempotent. If calls are
        still inside after ``timeout`` the client is left open (logged): closing it under
        them would crash the process."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            if not self._cond.wait_for(lambda: self._active == 0, timeout):
                log.error("%s: %d calls still running after %.0f s; the client is left open",
                          self.name, self._active, timeout)  # fmt: skip
                return
            native, self._native = self._native, None
        if native is not None:
            for ptr in self._buffers:
                native.unregister_buffer(ptr)
            native.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "down" if self.down else "up"
        return f"MooncakeStore({self.name!r}, master={self.settings.master}, {state})"


def split_codes(codes: Sequence[int] | None, n: int) -> list[int]:
    """``codes`` of a batch call, or ``n`` outage codes when the call was not made."""
    return list(codes) if codes is not None else [RPC_FAIL] * n
