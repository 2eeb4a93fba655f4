"""The scheduler's records: its counters, and what it keeps per job and per request.

Plain data, written and read by the ``OffloadingScheduler`` alone (``kvoffload.scheduler.core``
and the parts it joins).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.counters import Counters
from kvoffload.keys import OffloadKey
from kvoffload.manager import RequestContext
from kvoffload.scheduler.types import RequestView


@dataclass
class SchedulerStats(Counters):
    """Counters since creation: tokens handed to the engine from the tier (loads sent to
    the worker, failed ones included; a load cancelled before it was sent is not counted),
    blocks moved, failures."""

    tokens_loaded: int = 0
    loads_planned: int = 0  # load jobs handed out (one per request and step it loads in)
    blocks_loaded: int = 0
    blocks_stored: int = 0
    failed_loads: int = 0
    failed_load_tokens: int = 0  # tokens of failed loads: the engine recomputes them
    failed_stores: int = 0  # store jobs (one job may hold several requests' blocks)
    failed_tier_transfers: int = 0  # write-through or promotion copies between tiers
    skipped_stores: int = 0  # blocks held back by the reuse filter (store_threshold)
    declined_stores: int = 0  # blocks the tier had no room for (all of its slots in use)


@dataclass
class Job:
    req_id: str  # "" for a transfer between tiers
    is_store: bool
    keys: list[OffloadKey]
    token: int | None = None  # the manager's TierTransfer token
    tokens: int = 0  # a load: the tokens it hands to the engine
    # a store of several requests' blocks (``req_id`` is ""): each request and its keys
    parts: list[tuple[str, list[OffloadKey]]] | None = None


@dataclass(slots=True)
class RequestState:
    request: RequestView
    context: RequestContext
    block_ids: list[list[int]]
    stored_blocks: list[int]  # per group: offloaded blocks already stored or skipped
    touched_blocks: list[int]  # per group: offloaded blocks its match touched
    jobs: set[int] = field(default_factory=set)
    touched: bool = False
    finished: bool = False
    matched_from: int = 0  # the engine-cached tokens at the last match
    load_failed: bool = False  # a load for it failed: the engine recomputes, never retry
    computed_tokens: int = 0  # the most tokens whose KV it had
    loaded_blocks: list[int] = field(default_factory=list)  # per group: blocks a load reached
    keys: list[list[OffloadKey]] = field(default_factory=list)  # per group, from block 0
    inserted: set[OffloadKey] = field(default_factory=set)  # its completed stores' keys
    reused: set[OffloadKey] = field(default_factory=set)  # its completed loads' keys
    announced: bool = True  # on_new_request said, on_request_finished not yet
    load_sources: dict[str, int] = field(default_factory=dict)  # its last load's tokens per medium
    # per group: the blocks ``[lo, hi)`` its load found in the tier (never offered to it again)
    loaded_range: list[tuple[int, int]] = field(default_factory=list)
