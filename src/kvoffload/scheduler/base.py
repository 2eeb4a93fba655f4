"""The state every part of the ``OffloadingScheduler`` shares.

``SchedulerBase`` checks the configuration and holds the tables the parts read and write:
requests, jobs in flight, what the next plan hands the engine, the reuse filter and the
counters. The parts (``loads``, ``stores``, ``completion``; ``core`` joins them) subclass
it and call each other only through it: ``_new_job`` gives out job ids, ``_remember``
records what a key's ``BlockStored`` will say.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvoffload.events.types import KVEvent
from kvoffload.keys import BlockHasher, OffloadKey
from kvoffload.manager import OffloadingManager, RequestContext
from kvoffload.scheduler.blocks import BlockKeys
from kvoffload.scheduler.events import EventConverter
from kvoffload.scheduler.reuse import DEFAULT_MEMORY, ReuseFilter
from kvoffload.scheduler.sessions import SessionRegistry
from kvoffload.scheduler.state import Job, RequestState, SchedulerStats
from kvoffload.scheduler.types import BlockExtraKeys, KVGroup, TransferJob, view_extra_keys
from kvoffload.validation import positive_int

_NEVER = float("inf")


class SchedulerBase:
    """Configuration and tables of one ``OffloadingScheduler``."""

    def __init__(
        self,
        manager: OffloadingManager,
        groups: Sequence[KVGroup],
        hash_block_size: int,
        blocks_per_offload_block: int = 1,
        kv_events: str = "self_describing",
        hasher: BlockHasher | None = None,
        null_block_id: int | None = None,
        store_threshold: int = 1,
        store_threshold_memory: int = DEFAULT_MEMORY,
        block_extra_keys: BlockExtraKeys | None = None,
        offload_prompt_only: bool = False,
        event_classes: Mapping[type, type] | None = None,
    ) -> None:
        """``store_threshold``: requests that must ask for a block before it is stored
        (1 = store every block); ``store_threshold_memory``: keys whose count is kept;
        ``block_extra_keys(request, start, end)``: what besides tokens the engine hashes
        into the block ``[start, end)`` (salt, adapter, multimodal items, in
        ``kvoffload.keys`` tagged form); default ``view_extra_keys``;
        ``offload_prompt_only``: store blocks of prompt tokens only, not those generated;
        ``event_classes``: what ``take_events`` builds instead of ``BlockStored``,
        ``BlockRemoved`` and ``AllBlocksCleared`` (an engine's own types, taking the same
        fields positionally: no conversion per event)."""
        if not groups:
            raise ValueError("at least one KV-cache group is needed")
        positive_int("blocks_per_offload_block", blocks_per_offload_block)
        positive_int("hash_block_size", hash_block_size)
        self._offloaded = [g for g, group in enumerate(groups) if group.offloaded]
        if not self._offloaded:
            raise ValueError("no KV-cache group is offloaded")
        self._states = [g for g in self._offloaded if groups[g].is_state]
        if self._states and blocks_per_offload_block != 1:
            raise ValueError(
                f"KV-cache group {self._states[0]} holds recurrent states (one per device block): "
                f"blocks_per_offload_block must be 1, got {blocks_per_offload_block}"
            )
        self._fenced: dict[int, set[int]] = {}  # device block of a state -> store jobs reading it
        for g, group in enumerate(groups):
            if group.offloaded and group.block_size * blocks_per_offload_block % hash_block_size:
                raise ValueError(
                    f"offloaded block of group {g} ({group.block_size} x {blocks_per_offload_block} tokens) "
                    f"is not a multiple of the hash block size {hash_block_size}"
                )
        self.manager = manager
        self.null_block_id = null_block_id
        self.groups = list(groups)
        self.blocks_per_offload_block = blocks_per_offload_block
        self.hash_block_size = hash_block_size
        self._tokens = [group.block_size * blocks_per_offload_block for group in groups]
        self._extra_keys = block_extra_keys or view_extra_keys
        # the offloaded groups stored block by block: (group, tokens per block, volatile tail)
        self._block_groups = [
            (g, self._tokens[g], groups[g].volatile_tail) for g in self._offloaded if not groups[g].is_state
        ]
        self._blocks = BlockKeys(
            self._tokens, hash_block_size, hasher or BlockHasher(), self._extra_keys, null_block_id
        )
        self._events = EventConverter(groups, blocks_per_offload_block, kv_events, classes=event_classes)
        self._wire_events: list[KVEvent] = []
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[int, Job] = {}
        self._stale_jobs: set[int] = set()  # in flight at a reset: outcome not applied
        self._next_job_id = 0
        self._pending_loads: list[TransferJob] = []
        self._hold: dict[str, list[int]] = {}
        self._flush: dict[str, list[int]] = {}
        self._freeable: set[str] = set()
        # Per request, read in C loops by a decode step (``kvoffload.scheduler.stores``): the
        # computed tokens below which a request that only ran has nothing new to store (any
        # change to its ``stored_blocks`` resets it to 0: look again), and the computed
        # tokens the cheap form of its steps last said (folded into ``computed_tokens``
        # on every other path)
        self._store_at: dict[str, float] = {}
        self._running_computed: dict[str, int] = {}
        # A quiet decode step reads neither (``Stores._note_running``): the running ids,
        # their computed tokens and the slack of the last pass over them, while no store
        # bound changed since (``None`` otherwise: any write to ``_store_at`` resets it);
        # and the running lists not yet folded into ``_running_computed``
        self._quiet: tuple[list[str], list[int], float] | None = None
        self._unfolded: tuple[list[str], list[int]] | None = None
        self._reuse = ReuseFilter(store_threshold, store_threshold_memory)
        self.offload_prompt_only = offload_prompt_only
        self.stats = SchedulerStats()
        self.tokens_by_source: dict[str, int] = {}  # tokens_loaded per source medium (sources.py)
        # session controls (kvoffload.scheduler.sessions); an integration may replace it with
        # one configured otherwise before the first request
        self.sessions = SessionRegistry(manager)
        # requests whose tier choice stores to some lower tiers only: req_id -> those media
        self._store_limits: dict[str, frozenset[str]] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def _new_job(self, req_id: str, is_store: bool, keys: list[OffloadKey], token: int | None = None) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = Job(req_id, is_store, keys, token)
        if req_id:
            self._requests[req_id].jobs.add(job_id)
        return job_id

    def _computed_tokens(self, req_id: str, state: RequestState) -> int:
        """The most tokens whose KV the request had (``RequestState.computed_tokens``)."""
        self._fold_running()
        state.computed_tokens = max(state.computed_tokens, self._running_computed.pop(req_id, 0))
        return state.computed_tokens

    def _fold_running(self) -> None:
        """``_running_computed`` brought up to date with the last quiet steps' counts."""
        if self._unfolded is not None:
            ids, computed = self._unfolded
            self._unfolded = None
            self._running_computed.update(zip(ids, computed))

    def _store_start(self, context: RequestContext) -> float:
        """A new (or reset) request's first store bound: at once, or never for one whose
        tier choice stores nowhere."""
        return _NEVER if context.directives.tiers.stores_nowhere else 0

    def _forget(self, req_id: str) -> None:
        """The request is gone from ``_requests``: drop what the decode steps keep of it."""
        self._fold_running()
        self._quiet = None
        self._store_at.pop(req_id, None)
        self._running_computed.pop(req_id, None)
        if self._store_limits:
            self._store_limits.pop(req_id, None)

    def _limit_stores(self, parts: list[tuple[str, list[OffloadKey]]]) -> None:
        """Before a store job completes: its requests' tier choices for the write-through."""
        limits = self._store_limits
        for req_id, keys in parts:
            media = limits.get(req_id)
            if media is not None:
                self.manager.limit_write_through(keys, media)

    def _remember(self, state: RequestState, hashes, g: int, j: int, key: OffloadKey) -> None:
        """What offloaded block ``j`` of group ``g`` holds, for its ``BlockStored``."""
        tokens = self._tokens[g]
        parent = self._blocks.hash_at(hashes, g, j - 1) if j > 0 else None
        extra = self._extra_keys(state.request, j * tokens, (j + 1) * tokens)
        self._events.remember(key, parent, state.request.all_token_ids, j * tokens, (j + 1) * tokens, extra)
