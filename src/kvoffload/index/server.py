"""The index's HTTP API (aiohttp), in the shapes of Dynamo's standalone indexer and
Mooncake's indexer RFC (kvcache-ai/Mooncake#1403).

Endpoints (JSON in and out; errors are ``{"error": message, "field": name}`` with 400 for
a bad request, 404 for an unknown model/tenant or registration, 409 for a conflict):

* ``POST /register`` ``{instance_id, endpoint, model_name, block_size, tenant_id="default",
  dp_rank=0, replay_endpoint=null, topic=""}`` -> 201 ``{"status": "ok", ...}``: subscribes
  to the publisher at ``endpoint`` (that rank's own endpoint, nothing is derived).
* ``POST /unregister`` ``{instance_id, model_name, tenant_id?, dp_rank?}`` -> 200
  ``{"status": "ok", "removed": [...]}``; without ``tenant_id`` every tenant, without
  ``dp_rank`` every rank.
* ``GET /workers`` -> ``[{instance_id, model_name, tenant_id, block_size, endpoints:
  {rank: endpoint}, replay_endpoints: {rank: endpoint}, sources: {rank: {state, blocks:
  {gpu, cpu, disk, shared}, counters...}}}]``.
* ``POST /query`` ``{token_ids, model_name, tenant_id="default", lora_name?, cache_salt?}``
  and ``POST /query_by_hash`` ``{block_hashes, model_name, tenant_id="default",
  lora_name?}`` -> the score response:

  ``{"model_name", "tenant_id", "block_size", "num_blocks",
  "scores": {instance: {rank: device_tokens}}, "frequencies": [...],
  "tree_sizes": {instance: {rank: device_blocks}},
  "instances": {instance: {"longest_matched": tokens, "dp": {rank: {"gpu", "cpu",
  "disk", "shared", "weighted", "state"}}}}}``

  ``gpu`` <= ``cpu`` <= ``disk`` <= ``shared`` are cumulative matched tokens
  (``kvoffload.index.scoring``); ``weighted`` the tier-weighted tokens; ``state`` EXACT /
  DEGRADED / FALLBACK. ``longest_matched`` is the most any rank of the instance matches.
* ``GET /dump`` -> ``{"model:tenant": {"block_size", "groups", "entries": [{instance_id,
  dp_rank, tier, lora_name, group_idx, stride, block_hashes}]}}``.
* ``GET /metrics`` (Prometheus text, ``kvoffload.index.metrics``), ``GET /health``.

The server runs on uvloop's event loop when uvloop is installed (optional), else asyncio's.

Differences from Dynamo's standalone indexer (its HTTP shapes as read in its source and
docs; where they were not found, what was assumed is said):

* ``scores``/``frequencies``/``tree_sizes`` keep Dynamo's meaning (device-tier overlap in
  tokens of engines that match at least one block, engines per matched depth, device
  blocks held). ``instances`` carries the per-tier breakdown Dynamo added after Mooncake's
  RFC; Dynamo's exact field names there were not available, so the tiers are named
  ``gpu``/``cpu``/``disk`` as in Dynamo's docs, plus ``shared`` (STORAGE with locality
  REMOTE), ``weighted`` and ``state``, which Dynamo does not report. Every registered
  engine of the model appears in ``instances``, matched or not, so its state is visible.
* ``block_hashes`` are accepted as u64 or as i64 (Dynamo's type; negatives are read as
  two's complement). ``/query`` also takes ``cache_salt``; ``/query_by_hash`` takes
  ``lora_name``. Mooncake's ``model``/``modelname`` and ``seq_hashes`` are aliases.
* ``/register`` answers 201 with the engine's identity and state, not only a status;
  ``/unregister`` lists what it removed; ``/workers`` adds per-rank state and counters.
* ``/dump`` lists holdings per (engine, tier, LoRA, group), not Dynamo's router events.
* No peers (``/register_peer``...), no Mooncake ``/global_view``, no ``instance_id`` filter
  on queries.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from kvoffload.index.core import QueryResult
from kvoffload.index.metrics import IndexMetrics
from kvoffload.index.requests import BadRequest, parse
from kvoffload.index.service import IndexService, Registration, RegistrationConflict, check_instance_id
from kvoffload.index.tiers import TIER_NAMES

logger = logging.getLogger(__name__)

_SERVICE = web.AppKey("service", IndexService)
_METRICS = web.AppKey("metrics", IndexMetrics)
_TIMERS = web.AppKey("timers", dict)  # endpoint -> its latency histogram, labelled once
_JSON = "application/json"
_encode = msgspec.json.Encoder().encode


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=_encode(payload), status=status, content_type=_JSON)


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    return _json({"error": message, "field": field}, status)


def _answering_errors(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """``handler`` with the API's errors turned into their JSON answers. A wrapper per
    handler rather than a middleware: aiohttp runs middlewares through an extra chain of
    calls on every request, which a sub-millisecond query pays for."""

    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, str(exc), exc.field)
        except RegistrationConflict as exc:
            return _error(409, str(exc))
        except LookupError as exc:
            return _error(404, str(exc.args[0] if exc.args else exc))
        except ValueError as exc:
            message = str(exc)
            return _error(400, message, message.split(" ", 1)[0].rstrip(":"))

    return answer


def score_response(result: QueryResult) -> dict:
    """The JSON body of a query answer (see the module doc)."""
    size = result.block_size
    scores: dict[str, dict[str, int]] = {}
    tree_sizes: dict[str, dict[str, int]] = {}
    instances: dict[str, dict] = {}
    devices = []
    gpu, cpu, disk, shared = TIER_NAMES
    for match in result.matches:
        instance, rank = str(match.instance_id), str(match.dp_rank)
        device, host, local, remote = match.levels
        if device:
            scores.setdefault(instance, {})[rank] = device * size
            tree_sizes.setdefault(instance, {})[rank] = match.held[0]
            devices.append(device)
        entry = instances.get(instance)
        if entry is None:
            entry = instances[instance] = {"longest_matched": 0, "dp": {}}
        entry["dp"][rank] = {
            gpu: device * size,
            cpu: host * size,
            disk: local * size,
            shared: remote * size,
            "weighted": match.weighted * size,
            "state": match.state.value,
        }
        if remote * size > entry["longest_matched"]:
            entry["longest_matched"] = remote * size
    return {
        "model_name": result.model,
        "tenant_id": result.tenant,
        "block_size": size,
        "num_blocks": result.num_blocks,
        "scores": scores,
        "frequencies": _frequencies(devices),
        "tree_sizes": tree_sizes,
        "instances": instances,
    }


def _frequencies(devices: list[int]) -> list[int]:
    """Engines matching at each depth: all of them up to the shortest device match, one
    fewer past each longer one."""
    frequencies: list[int] = []
    remaining, reached = len(devices), 0
    for length in sorted(devices):
        frequencies += [remaining] * (length - reached)
        remaining, reached = remaining - 1, length
    return frequencies


async def _register(request: web.Request) -> web.Response:
    req = parse("register", await request.read())
    try:
        reg = Registration(
            instance_id=req.instance_id,  # type: ignore[arg-type]
            endpoint=req.endpoint,  # type: ignore[arg-type]
            model_name=req.model_(),
            block_size=req.block_size,  # type: ignore[arg-type]
            tenant_id=req.tenant_id,
            dp_rank=req.dp_rank,
            replay_endpoint=req.replay_endpoint,
            topic=req.topic,
        )
    except ValueError as exc:
        message = str(exc)
        raise BadRequest(message.split(" ", 1)[0].rstrip(":"), message) from None
    service = request.app[_SERVICE]
    source = await asyncio.get_running_loop().run_in_executor(None, service.register, reg)
    return _json(
        {
            "status": "ok",
            "instance_id": reg.instance_id,
            "dp_rank": reg.dp_rank,
            "model_name": reg.model_name,
            "tenant_id": reg.tenant_id,
            "endpoint": source.endpoint,
            "replay_endpoint": source.replay_endpoint,
            "state": source.state.value,
        },
        201,
    )


async def _unregister(request: web.Request) -> web.Response:
    req = parse("unregister", await request.read())
    try:
        check_instance_id(req.instance_id)
    except ValueError as exc:
        raise BadRequest("instance_id", str(exc)) from None
    service = request.app[_SERVICE]
    removed = await asyncio.get_running_loop().run_in_executor(
        None, service.unregister, req.instance_id, req.model_(), req.tenant_id, req.dp_rank
    )
    return _json(
        {
            "status": "ok",
            "removed": [
                {
                    "instance_id": r.instance_id,
                    "dp_rank": r.dp_rank,
                    "model_name": r.model_name,
                    "tenant_id": r.tenant_id,
                }
                for r, _ in removed
            ],
        }
    )


async def _workers(request: web.Request) -> web.Response:
    workers: dict[tuple, dict] = {}
    for reg, source in request.app[_SERVICE].sources():
        key = (reg.model_name, reg.tenant_id, reg.instance_id)
        entry = workers.setdefault(
            key,
            {
                "instance_id": reg.instance_id,
                "model_name": reg.model_name,
                "tenant_id": reg.tenant_id,
                "block_size": reg.block_size,
                "endpoints": {},
                "replay_endpoints": {},
                "sources": {},
            },
        )
        rank = str(reg.dp_rank)
        entry["endpoints"][rank] = source.endpoint
        entry["replay_endpoints"][rank] = source.replay_endpoint
        entry["sources"][rank] = {
            "state": source.state.value,
            "blocks": dict(zip(TIER_NAMES, source.engine.blocks)),
            **source.stats().as_dict(),
            "subscriber": source.subscriber_stats(),
        }
    return _json(list(workers.values()))


async def _query(request: web.Request) -> web.Response:
    started = time.perf_counter()
    req = parse("query", await request.read())
    index = request.app[_SERVICE].index
    # Hashing a long prompt's tokens takes milliseconds: keep the event loop free meanwhile.
    result = await asyncio.get_running_loop().run_in_executor(
        None, index.query_tokens, req.model_(), req.tenant_id, req.token_ids, req.lora_name, req.cache_salt
    )
    response = _json(score_response(result))
    request.app[_TIMERS]["query"].observe(time.perf_counter() - started)
    return response


async def _query_by_hash(request: web.Request) -> web.Response:
    started = time.perf_counter()
    req = parse("query_by_hash", await request.read())
    result = request.app[_SERVICE].index.query_hashes(
        req.model_(), req.tenant_id, req.block_hashes, req.lora_name
    )
    response = _json(score_response(result))
    request.app[_TIMERS]["query_by_hash"].observe(time.perf_counter() - started)
    return response


async def _dump(request: web.Request) -> web.Response:
    dump = await asyncio.get_running_loop().run_in_executor(None, request.app[_SERVICE].index.dump)
    return _json({f"{d.pop('model_name')}:{d.pop('tenant_id')}": d for d in dump})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[_METRICS].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


def create_app(service: IndexService, metrics: IndexMetrics | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_SERVICE] = service
    app[_METRICS] = metrics = metrics or IndexMetrics(service)
    app[_TIMERS] = {name: metrics.query_seconds.labels(name) for name in ("query", "query_by_hash")}
    router, wrap = app.router, _answering_errors
    router.add_post("/register", wrap(_register))
    router.add_post("/unregister", wrap(_unregister))
    router.add_get("/workers", wrap(_workers))
    router.add_post("/query", wrap(_query))
    router.add_post("/query_by_hash", wrap(_query_by_hash))
    router.add_get("/dump", wrap(_dump))
    router.add_get("/metrics", wrap(_metrics))
    router.add_get("/health", wrap(_health))
    return app


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (an optional speed-up: its transports
    cost less per request), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class IndexServer:
    """Runs the API on ``host:port`` (port 0: the OS picks) in a thread of its own.

    ``start()`` returns once the port is bound (``url`` is then known); ``stop()`` closes
    the server and, if it owns it, the service (every source stops)."""

    def __init__(
        self, service: IndexService, host: str = "127.0.0.1", port: int = 0, *, own_service: bool = True
    ) -> None:
        self.service = service
        self.host = host
        self.port = port
        self._own_service = own_service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> IndexServer:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = self._loop = _new_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._setup())
            except BaseException as exc:  # bind failures surface in start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())  # type: ignore[union-attr]
            loop.close()

        self._thread = threading.Thread(target=run, name="kv-index-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise ValueError(f"cannot serve the index on {self.host}:{self.port}: {failure[0]}") from failure[
                0
            ]
        return self

    async def _setup(self) -> None:
        self._runner = web.AppRunner(create_app(self.service), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def stop(self) -> None:
        """Stop serving (idempotent); then stop the service's sources if owned."""
        if self._thread is not None and self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._thread = None
        if self._own_service:
            self.service.close()

    def __enter__(self) -> IndexServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
