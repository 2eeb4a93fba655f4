"""The fault script a soak phase runs beside the load: Redis killed (SIGKILL, by PID) and
started again, the disk tier's file system filled to ENOSPC and freed.

Faults are driven by progress, not by the clock: each step fires once the server has
finished a given number of requests (``vllm:request_success_total`` on ``/metrics``), so
every step lands inside the load on any machine, however slow. ``FaultScript(server,
redis, tmpfs, steps)`` with steps ``[(after_requests, action), ...]``, actions
``kill_redis``, ``start_redis``, ``fill_disk``, ``free_disk``; ``run_in_background()``,
then ``finish()`` when the load is done: it stops the thread and puts back whatever is
still broken (Redis down, the disk full), so that the next phase and the end-of-run
samples start from a healthy system. ``log`` records each step with the requests finished
when it fired and whether it fired during the load.

``cycle_steps(start, requests, cycles)`` spreads ``cycles`` kill/restart/fill/free cycles
over a phase's ``requests``.
"""

from __future__ import annotations

import threading
import time

from _soak_probe import finished_requests

KILL, START, FILL, FREE = "kill_redis", "start_redis", "fill_disk", "free_disk"


def cycle_steps(
    start: float, requests: int, cycles: int, free_first: bool = False
) -> list[tuple[float, str]]:
    """Per cycle, over its share of ``requests``: Redis down from 1/8 to 3/8, the disk full
    from 1/2 to 7/8. ``free_first``: the disk is full when the phase starts, and is freed
    after its first 1/16."""
    steps: list[tuple[float, str]] = [(start + max(1, requests // 16), FREE)] if free_first else []
    share = requests / max(1, cycles)
    for c in range(cycles):
        base = start + c * share
        for frac, action in ((1 / 8, KILL), (3 / 8, START), (1 / 2, FILL), (7 / 8, FREE)):
            steps.append((base + max(1, int(frac * share)), action))
    return steps


class FaultScript:
    def __init__(
        self,
        server,
        redis,
        tmpfs,
        steps: list[tuple[float, str]],
        poll_s: float = 0.25,
        disk_full: bool = False,
    ) -> None:
        self.server = server
        self.redis = redis
        self.tmpfs = tmpfs
        self.steps = sorted(steps, key=lambda s: s[0])
        self.poll_s = poll_s
        self.log: list[dict] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._redis_down = False
        self._disk_full = disk_full
        self.errors: list[str] = []

    def run_in_background(self) -> FaultScript:
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        pending = list(self.steps)
        start = time.monotonic()
        while pending and not self._done.is_set():
            try:
                done = finished_requests(self.server.scrape())
            except OSError:
                done = -1.0
            while pending and done >= pending[0][0]:
                threshold, action = pending.pop(0)
                self._act(action, done, time.monotonic() - start, during_load=True)
            self._done.wait(self.poll_s)  # polls a condition (requests finished)

    def _act(self, action: str, done: float, t: float, during_load: bool) -> None:
        entry: dict = {
            "action": action,
            "requests_finished": done,
            "t_s": round(t, 2),
            "during_load": during_load,
        }
        try:
            if action == KILL:
                entry["pid"] = self.redis.proc.pid if self.redis.proc else None
                self.redis.kill()
                self._redis_down = True
            elif action == START:
                self.redis.start()
                entry["pid"] = self.redis.proc.pid
                self._redis_down = False
            elif action == FILL:
                if self.tmpfs is None:
                    entry["skipped"] = "no tmpfs"
                else:
                    entry["filler_bytes"] = self.tmpfs.fill()
                    entry["free_bytes_after"] = self.tmpfs.free_bytes()
                    self._disk_full = True
            elif action == FREE:
                if self.tmpfs is not None:
                    self.tmpfs.free()
                    entry["free_bytes_after"] = self.tmpfs.free_bytes()
                self._disk_full = False
        except Exception as e:  # recorded and reported, never left silent
            entry["error"] = repr(e)
            self.errors.append(f"{action}: {e!r}")
        self.log.append(entry)

    def finish(self) -> list[dict]:
        self._done.set()
        if self._thread is not None:
            self._thread.join(60)
        if self._redis_down:
            self._act(START, -1, 0.0, during_load=False)
        if self._disk_full:
            self._act(FREE, -1, 0.0, during_load=False)
        return self.log

    def fired_during_load(self, action: str) -> int:
        return sum(1 for e in self.log if e["action"] == action and e["during_load"] and "error" not in e)
