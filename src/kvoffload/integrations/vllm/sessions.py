"""The session part of the vLLM scheduler-side adapter: the ways in, for one engine.

* Each new request's directives (``kvoffload.directives``) are read from vLLM's request
  fields: ``session_id`` (its tenant the ``cache_salt``), ``kv_hints`` and
  ``kv_transfer_params``; once per request, kept until it finishes, when what was applied
  goes back to the client in the response's ``kv_transfer_params`` under ``"kvoffload"``.
* The HTTP control endpoint (``kvoffload.control``), when ``control_port`` is set (on
  that port plus the engine's local data-parallel rank): its commands run on the
  scheduler's ``sessions`` registry through a ``ControlQueue``, drained at the start of
  each step (``drain``) or, while the engine idles, under the connector's ``serial`` lock.
* ``pending_work()``: whether session prefetches are queued or in flight; the connector
  reports it as vLLM's ``has_pending_push_work``, so an engine with no request keeps
  stepping until they are done (vLLM steps only while it has requests or a connector's
  pending work: a prefetch at a pause's end would otherwise wait for the next request).
  An engine core blocked on its input queue (a server with no request at all) is woken
  only by its next request.
* ``prefix_keys``: a token prefix's keys exactly as this engine computes them (vLLM's own
  block hasher, its hash function and seed), for ``POST /prefetch``; a model with several
  offloaded KV-cache groups is refused by name.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from kvoffload.control.queue import ControlQueue
from kvoffload.control.server import ControlServer
from kvoffload.directives import PARAMS_KEY, DirectiveReader, Reading
from kvoffload.integrations.vllm.config import OffloadConfig
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.sessions import NO_DIRECTIVES, SessionDirectives

_NOTHING = Reading()


class SessionSide:
    """Directives of requests in, what was read back out; the control endpoint's queue."""

    def __init__(
        self, vllm_config: Any, side: SchedulerSide, config: OffloadConfig, serial: threading.Lock
    ) -> None:
        """``serial``: the lock the connector holds for each of vLLM's scheduler-side calls."""
        self.reader = DirectiveReader(frozenset(side.media))
        self._readings: dict[str, Reading] = {}
        self.queue = ControlQueue(serial)
        self._manager = side.scheduler.manager
        self._offloaded = side.offloaded
        self._hash_block_size = side.hash_block_size
        self._block_tokens = side.block_tokens
        self._hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self.server = None
        if config.control_port is not None:
            port = config.control_port
            if port:  # data parallel engines on one host: one port each
                port += vllm_config.parallel_config.data_parallel_rank_local or 0
            self.server = ControlServer(
                self.queue,
                side.scheduler.sessions,
                config.control_host,
                port,
                config.control_token,
                config.control_timeout_s,
                self.prefix_keys,
                config.control_tenant_tokens,
            )

    def directives(self, request: Request) -> SessionDirectives:
        """The request's directives, read on first sight."""
        reading = self._readings.get(request.request_id)
        if reading is None:
            session_id = getattr(request, "session_id", None)
            hints = getattr(request, "kv_hints", None)
            params = request.kv_transfer_params
            if session_id is None and hints is None and not (params and PARAMS_KEY in params):
                return NO_DIRECTIVES
            actions = hints.actions if hints is not None else None
            reading = self.reader.read(request.request_id, session_id, request.cache_salt, params, actions)
            self._readings[request.request_id] = reading
        return reading.directives

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """What goes back to the client: the directives the request's fields gave."""
        reading = self._readings.pop(req_id, _NOTHING)
        return None if reading is _NOTHING else {PARAMS_KEY: reading.report()}

    def pending_work(self) -> bool:
        pending = getattr(self._manager, "prefetch_pending", None)
        return pending is not None and pending()

    def drain(self) -> None:
        if len(self.queue):
            self.queue.drain()

    def prefix_keys(self, tenant: str, token_ids: list[int]) -> list[OffloadKey]:
        """The keys of ``token_ids``' whole offloaded blocks, for a request of ``tenant``."""
        if len(self._offloaded) != 1:
            raise ValueError(
                f"prefetch of a token prefix needs a model with one offloaded KV-cache group; this one has "
                f"{len(self._offloaded)} (prefetch its sessions instead)"
            )
        request = Request(
            "kvoffload-prefetch",
            token_ids,
            SamplingParams(max_tokens=1),
            None,
            cache_salt=tenant or None,
            block_hasher=get_request_block_hasher(self._hash_block_size, self._hash_fn),
        )
        hashes = request.block_hashes
        g, step = self._offloaded[0], self._block_tokens[0] // self._hash_block_size
        return [make_offload_key(hashes[end - 1], g) for end in range(step, len(hashes) + 1, step)]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
