"""Where a tier hit's time to first token goes, on an in-process vLLM engine.

``Timeline.attach(llm)`` wraps (on the instances, for the bench only) the calls a request
goes through on its way to its first token, each stamped with ``time.perf_counter`` and
the thread that made it: the request added (``arrival``), each engine step (``step``,
``schedule``, the connector's ``match`` and ``meta``, ``execute``), the worker half
(``start_load_kv``, ``get_finished``), the router (a job submitted,
``wait``), the movers (a promotion's reads and their end, the load's copy and its end)
and the outputs reaching the caller (``outputs``). ``record(label)`` between
``begin()`` and ``end()`` keeps one request's events; ``phases(events)`` turns them into
the intervals printed by ``bench_tier_ttft.py``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

from kvoffload.demo.offline import worker_connector
from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE


class Timeline:
    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []
        self.on = False

    def begin(self) -> None:
        self.events, self.on = [], True

    def end(self) -> list[tuple[float, str, str]]:
        self.on = False
        return self.events

    def record(self, label: str) -> None:
        if self.on:
            self.events.append((time.perf_counter(), label, threading.current_thread().name))

    def wrap(self, obj: object, name: str, label: str | Callable[..., str | None], ends: bool = True) -> None:
        """Stamp ``obj.name``'s calls: ``label`` (or ``label(*args)``, ``None`` for a call
        not to stamp) on entry, ``label <`` on return when ``ends``."""
        inner = getattr(obj, name)

        @functools.wraps(inner)
        def stamped(*args, **kwargs):
            tag = label(*args, **kwargs) if callable(label) else label
            if tag is None or not self.on:
                return inner(*args, **kwargs)
            self.record(tag)
            try:
                return inner(*args, **kwargs)
            finally:
                if ends:
                    self.record(tag + " <")

        setattr(obj, name, stamped)

    def attach(self, llm) -> None:
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        self.wrap(engine, "add_request", "arrival", ends=False)
        self.wrap(engine.output_processor, "process_outputs", "outputs")
        self.wrap(core.scheduler, "schedule", "schedule")
        scheduler_side = core.scheduler.get_kv_connector()
        self.wrap(scheduler_side, "get_num_new_matched_tokens", "match")
        self.wrap(scheduler_side, "build_connector_meta", "meta")
        self.wrap(scheduler_side, "update_connector_output", "connector_output")
        self.wrap(core.model_executor, "execute_model", "execute")
        self.wrap(core.model_executor, "sample_tokens", "sample")
        connector = worker_connector()
        self.wrap(connector, "start_load_kv", "start_load_kv")
        self.wrap(connector, "get_finished", "get_finished")
        self.wrap(connector, "wait_for_save", "wait_for_save")
        router = connector._worker.worker
        self.wrap(router, "submit", lambda job_id, src, dst: f"submit {src.medium}->{dst.medium}", ends=False)
        self.wrap(router, "wait", "router.wait")
        for worker in router.workers:
            kind = type(worker).__name__
            if kind == "TransferEngine":
                self.wrap(worker._executor, "launch", lambda store, *a: None if store else "load copy")
                self._finish(worker, lambda r: "load finished" if r.direction == "load" else None)
            elif kind == "FSWorker":
                self.wrap(worker, "_prepare", lambda job: None if job.store else "promotion started")
                # the movers hold their bound _load_run from the start: stamp the files' read
                self.wrap(worker.files, "read_run", lambda first, keys, blocks: f"disk read {len(keys)}")
                self._finish(worker, lambda r: "promotion finished" if r.direction == "disk_load" else None)
            elif kind == "RedisWorker":
                self.wrap(worker, "_load", lambda ids, keys: f"redis read {len(ids)}")
                self._finish(worker, lambda r: "promotion finished" if r.direction == "load" else None)

    def _finish(self, worker, label: Callable) -> None:
        book = worker._jobs
        inner = book.finish

        def finish(result):
            tag = label(result)
            if tag is not None:
                self.record(tag)
            return inner(result)

        book.finish = finish


def phases(events: list[tuple[float, str, str]]) -> dict[str, float]:
    """Marks (ms) of one request's events, from its arrival: its first match, the
    promotion (submitted, started, finished), the load (submitted, its first copy started,
    its last copy finished), the end of the last ``start_load_kv`` (the wait for this
    step's loads), of the last step's model execution, and the outputs; then the engine
    steps and the load's copies (pieces) counted. A mark the request did not reach is
    absent."""
    if not events:
        return {}
    t0 = next((t for t, label, _ in events if label == "arrival"), events[0][0])

    def first(label: str, after: float = 0.0) -> float | None:
        return next(
            ((t - t0) * 1e3 for t, lab, _ in events if lab == label and (t - t0) * 1e3 >= after), None
        )

    def last(label: str) -> float | None:
        found = [(t - t0) * 1e3 for t, lab, _ in events if lab == label]
        return found[-1] if found else None

    out: dict[str, float] = {}
    promotion = [f"submit {m}->{MEDIUM_CPU}" for m in ("DISK", "REMOTE", "SHARED")]
    marks = {
        "first match": first("match"),
        "first match end": first("match <"),
        "first start_load_kv": first("start_load_kv"),
        "promotion submitted": next((first(p) for p in promotion if first(p) is not None), None),
        "promotion started": first("promotion started"),
        "promotion finished": first("promotion finished"),
        "load submitted": first(f"submit {MEDIUM_CPU}->{MEDIUM_DEVICE}"),
        "load copy": first("load copy"),
        "load finished": last("load finished"),
        "last start_load_kv end": last("start_load_kv <"),
        "last execute end": last("execute <"),
        "outputs": last("outputs"),
    }
    for name, value in marks.items():
        if value is not None:
            out[name] = value
    out["steps"] = sum(1 for _, label, _ in events if label == "schedule")
    out["load copies"] = sum(1 for _, label, _ in events if label == "load copy")
    return out


def timeline_text(events: list[tuple[float, str, str]]) -> str:
    """One request's events, ``label@ms`` from its arrival, ``[thread]`` off the main one."""
    if not events:
        return ""
    t0 = next((t for t, label, _ in events if label == "arrival"), events[0][0])
    main = threading.main_thread().name
    parts = []
    for t, label, thread in events:
        where = "" if thread == main else f"[{thread.removeprefix('kvoffload-')}]"
        parts.append(f"{label}{where}@{(t - t0) * 1e3:.2f}")
    return " ".join(parts)
