"""``KVOffloadStorage``: kvoffload's tiers as SGLang's HiCache storage backend (its L3).

SGLang (0.5.23 and later) loads it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "kvoffload", "module_path":
"kvoffload.integrations.sglang", "class_name": "KVOffloadStorage", "interface_v1": 1,
"secondary_tiers": [...]}'`` (keys: ``kvoffload.integrations.sglang.config``), builds it as
``cls(storage_config, {})`` and hands it its host pool (``register_mem_pool_host``), where
the tiers are built: SGLang's host pool is the L2, kvoffload's disk, Redis/Valkey and
Mooncake tiers hold the pages below it.

* With ``interface_v1`` SGLang calls ``batch_exists``, ``batch_set_v1`` and
  ``batch_get_v1`` with page keys and host-pool slots: the tiers write from and read into
  the pool's pages in place (``PageViews``). Without it, the whole-page methods (``get``,
  ``batch_get``, ``set``, ``batch_set``, ``exists``), whose pages go through a staging
  buffer (one copy). Calling the other kind's methods is a ``RuntimeError`` naming the key.
* A page key is SGLang's 64-hex-digit SHA-256 chain value; anything else is a
  ``ValueError`` naming it, as are host slots that are not whole pages.
* Every page read is checked by its tier (key, namespace, CRC32C): a bad page is a miss
  SGLang recomputes, counted and dropped. A tier that fails (a dead server, a full disk)
  costs misses and declined stores: nothing from a tier reaches SGLang as an exception
  (SGLang would treat it as a miss and log it; here it is counted in ``errors`` and
  logged once a while), and no call waits past the tiers' own timeouts.
* Namespaces: ``kvoffload.integrations.sglang.identity``. A tier's ``bytes_to_use`` is the
  total over the tensor-parallel ranks (MHA: each rank's process keeps its share of every
  page); MLA ranks share one namespace that the first rank writes. MLA with several ranks
  on the disk tier is refused (the other ranks' indexes would never see the writer's pages).
* Events (``kv_events_endpoint``): the pages the tiers store and drop, published by the
  first tensor-parallel and pipeline rank (``kvoffload.integrations.sglang.events``).
  Metrics: registered with ``kvoffload.metrics`` and served when ``metrics_port`` is set.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvoffload.extras import require

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:
    for _module in ("torch", "sglang"):  # an ImportError naming the extra
        require(_module, "sglang", "kvoffload's SGLang storage backend")
    raise

from kvoffload.events.types import AllBlocksCleared
from kvoffload.integrations.sglang.config import StorageSettings
from kvoffload.integrations.sglang.events import PageEvents
from kvoffload.integrations.sglang.identity import is_writer, page_identity, ranks_sharing_budget
from kvoffload.integrations.sglang.metrics import StorageMetrics
from kvoffload.integrations.sglang.pages import PageViews, StagingPages
from kvoffload.integrations.sglang.tiers import PageTiers
from kvoffload.keys import OffloadKey
from kvoffload.tiers.secondary import TierContext

logger = logging.getLogger(__name__)

STAGING_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: pages per whole-page call it makes
_GROUP = (0).to_bytes(4, "big")
_LOG_EVERY_S = 30.0


def page_key(key: Any) -> OffloadKey:
    """SGLang's page key (64 hex digits) as an ``OffloadKey`` of group 0."""
    if not isinstance(key, str) or len(key) != 64:
        raise ValueError(f"an SGLang page key must be 64 hex digits, got {key!r}")
    try:
        return OffloadKey(bytes.fromhex(key) + _GROUP)
    except ValueError:
        raise ValueError(f"an SGLang page key must be 64 hex digits, got {key!r}") from None


def _page_keys(keys: Sequence[Any]) -> list[OffloadKey]:
    return [page_key(key) for key in keys]


class KVOffloadStorage(HiCacheStorage):
    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = StorageSettings.parse(getattr(storage_config, "extra_config", None))
        self.writer = is_writer(storage_config)
        self.tiers: PageTiers | None = None
        self.views: PageViews | None = None
        self.errors = 0
        self._staging: StagingPages | None = None
        self._get_lock = threading.Lock()  # the staging's first half (whole-page loads)
        self._set_lock = threading.Lock()  # its second half (whole-page stores)
        self._events: PageEvents | None = None
        self._publisher: Any = None
        self._metrics: StorageMetrics | None = None
        self._last_log = 0.0
        self._closed = False

    # -- set-up ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.tiers is not None:
            raise RuntimeError("the kvoffload backend's host pool is registered already")
        config, settings = self.storage_config, self.settings
        views = PageViews(mem_pool_host)
        tp_size = int(getattr(config, "tp_size", 1) or 1)
        if views.kind == "mla" and tp_size > 1 and any(t.type_name == "fs" for t in settings.secondary_tiers):
            raise ValueError(
                f"secondary_tiers: the fs tier with an MLA model on tp_size={tp_size} is not supported (only "
                "the first rank writes pages, and the other ranks' disk indexes would never see them); use a "
                "shared tier (redis, mooncake)"
            )
        share = ranks_sharing_budget(config, views)
        tiers = [self._share(tier, share) for tier in settings.secondary_tiers]
        context = TierContext(views.block_bytes, page_identity(config, views, settings.namespace_extra))
        if settings.interface_v1:
            pool: Any = views
        else:
            pool = self._staging = StagingPages(2 * STAGING_PAGES, views.block_bytes)
        self._metrics = StorageMetrics()
        self.tiers = PageTiers(tiers, context, pool, settings.eviction_policy, self._metrics.meter)
        self.views = views
        self._metrics.attach(self.tiers, errors=lambda: self.errors, port=self._port())
        media = [manager.medium for manager in self.tiers.managers]
        self._events = PageEvents(views.page_size, media)
        if settings.kv_events_endpoint and self._publishes():
            from kvoffload.events.publisher import ZmqEventPublisher

            self._publisher = ZmqEventPublisher(
                settings.kv_events_endpoint,
                settings.kv_events_replay_endpoint,
                topic=settings.kv_events_topic,
                data_parallel_rank=int(getattr(config, "dp_rank", 0) or 0),
            )
            self._metrics.add_publisher(self._publisher)

    @staticmethod
    def _share(tier: Any, ranks: int) -> Any:
        """``tier`` with each rank's part of its ``bytes_to_use``."""
        total = getattr(tier, "bytes_to_use", None)
        if ranks == 1 or total is None:
            return tier
        tier = copy.copy(tier)
        tier.bytes_to_use = total // ranks
        return tier

    def _publishes(self) -> bool:
        config = self.storage_config
        return all(int(getattr(config, name, 0) or 0) == 0 for name in ("tp_rank", "pp_rank", "attn_cp_rank"))

    def _port(self) -> int | None:
        port = self.settings.metrics_port
        if port is None or port == 0:
            return port
        return port + int(getattr(self.storage_config, "tp_rank", 0) or 0)

    def _ready(self) -> PageTiers:
        if self.tiers is None:
            raise RuntimeError("the kvoffload backend has no host pool yet (register_mem_pool_host)")
        return self.tiers

    def _interface(self, method: str, v1: bool) -> None:
        if self.settings.interface_v1 != v1:
            want = 1 if v1 else 0
            raise RuntimeError(
                f"{method} needs interface_v1={want} in hicache_storage_backend_extra_config (the tiers were "
                f"built over {'SGLang host pool' if self.settings.interface_v1 else 'a staging buffer'})"
            )

    # -- the zero-copy interface -------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        tiers, okeys = self._ready(), _page_keys(keys)
        return self._guard("batch_exists", 0, tiers.exists, okeys, self.settings.exists_wait_s)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        self._interface("batch_get_v1", True)
        tiers, okeys = self._ready(), _page_keys(keys)
        pages = self.views.page_ids(host_indices, len(okeys))
        return self._guard("batch_get_v1", [False] * len(okeys), tiers.load, okeys, pages)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        self._interface("batch_set_v1", True)
        tiers, okeys = self._ready(), _page_keys(keys)
        pages = self.views.page_ids(host_indices, len(okeys))
        if not self.writer:
            return [True] * len(okeys)  # (SGLang skips the backups of ranks that do not write)
        self._remember(okeys, extra_info)
        return self._guard("batch_set_v1", [False] * len(okeys), tiers.store, okeys, pages)

    def _remember(self, okeys: list[OffloadKey], extra_info: Any) -> None:
        prefix = getattr(extra_info, "prefix_keys", None)
        parent = page_key(prefix[-1]) if prefix else None
        self._events.remember(okeys, parent)

    # -- the whole-page interface (one copy through the staging buffer) ---------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        self._interface("batch_get", False)
        tiers, okeys = self._ready(), _page_keys(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(okeys)
        if len(targets) != len(okeys):
            raise ValueError(f"batch_get: {len(okeys)} keys but {len(targets)} target locations")
        out: list[torch.Tensor | None] = [None] * len(okeys)
        staging = self._staging
        with self._get_lock:
            for start in range(0, len(okeys), STAGING_PAGES):
                chunk = okeys[start : start + STAGING_PAGES]
                rows = list(range(len(chunk)))
                ok = self._guard("batch_get", [False] * len(chunk), tiers.load, chunk, rows)
                for i, loaded in enumerate(ok):
                    if not loaded:
                        return out
                    target = targets[start + i]
                    if target is None:
                        target = torch.empty(self.views.block_bytes, dtype=torch.uint8)
                    out[start + i] = staging.take(i, target)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        self._interface("batch_set", False)
        tiers, okeys = self._ready(), _page_keys(keys)
        values = list(values) if values is not None else []
        if len(values) != len(okeys):
            raise ValueError(f"batch_set: {len(okeys)} keys but {len(values)} values")
        if not self.writer:
            return True
        self._events.remember(okeys, None)
        staging = self._staging
        with self._set_lock:
            for start in range(0, len(okeys), STAGING_PAGES):
                chunk = okeys[start : start + STAGING_PAGES]
                rows = [STAGING_PAGES + i for i in range(len(chunk))]
                for i, row in enumerate(rows):
                    staging.put(row, values[start + i])
                ok = self._guard("batch_set", [False] * len(chunk), tiers.store, chunk, rows)
                if not all(ok):
                    return False
        return True

    # -- housekeeping ------------------------------------------------------------------------

    def clear(self) -> bool:
        """Forget every page the tiers hold (SGLang's ``clear_storage_backend``, with no
        request in flight); announced as ``AllBlocksCleared``."""
        tiers = self._ready()
        for manager in tiers.managers:
            manager.reset()
        tiers.take_events()  # (one AllBlocksCleared says it all)
        if self._publisher is not None:
            self._publisher.publish([AllBlocksCleared()])
        return True

    def get_stats(self) -> None:
        return None  # SGLang's own storage metrics stay empty; kvoffload's are Prometheus metrics

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:
            self._metrics.close()
        if self.tiers is not None:
            self._publish()
            self.tiers.close()
        if self._publisher is not None:
            self._publisher.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- every call's end ---------------------------------------------------------------------

    def _guard(self, method: str, failed: Any, call: Any, *args: Any) -> Any:
        """``call(*args)``, then the events it caused published; an exception from the tiers is
        logged (at most once per ``_LOG_EVERY_S``), counted in ``errors`` and answered
        ``failed``: SGLang recomputes instead."""
        try:
            return call(*args)
        except Exception:
            self.errors += 1
            now = time.monotonic()
            if now - self._last_log >= _LOG_EVERY_S:
                self._last_log = now
                logger.exception("kvoffload %s failed (%d errors so far): misses", method, self.errors)
            return failed
        finally:
            self._publish()

    def _publish(self) -> None:
        tiers = self.tiers
        if tiers is None:
            return
        events = tiers.take_events()
        if events and self._publisher is not None:
            wire = self._events.convert(events)
            if wire:
                self._publisher.publish(wire)
