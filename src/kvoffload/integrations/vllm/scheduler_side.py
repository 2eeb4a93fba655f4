"""The scheduler half of ``KVOffloadConnector``: vLLM's requests and steps, translated for
the engine-agnostic ``OffloadingScheduler``, and its wire events converted to vLLM's own
event classes (so they reach vLLM's KV-event publisher next to the engine's ``GPU`` events).

Tenant isolation comes from vLLM: offload keys are its request block hashes, which mix in
the cache salt, the LoRA adapter and multimodal items, so two tenants' prompts never share
an offloaded block; ``BlockStored`` carries those as ``extra_keys`` and ``lora_name``.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress
from typing import Any

import msgspec
from vllm.distributed import kv_events as vllm_events
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvoffload.events import types as kv_types
from kvoffload.integrations.vllm.config import OffloadConfig
from kvoffload.integrations.vllm.groups import kv_groups
from kvoffload.integrations.vllm.identity import kv_identity
from kvoffload.integrations.vllm.layout import host_block_bytes
from kvoffload.integrations.vllm.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata
from kvoffload.scheduler import OffloadingScheduler, RunningRequests, StepRequest
from kvoffload.scheduler.passes import tokens_after
from kvoffload.sessions import NO_DIRECTIVES, SessionDirectives
from kvoffload.tiers.factory import build_manager

# vLLM's block pool hands out block 0 as its null block, the placeholder for positions
# outside a sliding window.
NULL_BLOCK_ID = 0


def _extra_keys(request: Request, start: int, end: int) -> Any:
    # vLLM's own per-block extra keys (salt, LoRA, multimodal, prompt embeds): the keys
    # come from its block hashes, which hold them; the events say them as its engine does.
    # A request with none of their sources (those of vLLM 0.32-0.34's function: multimodal
    # features, LoRA, cache salt, prompt embeds) has none for any block: said without
    # building vLLM's lists (a block-completion step of a thousand decoding requests asks
    # for each). A release that adds a source must be added here.
    if (
        not request.mm_features
        and request.lora_request is None
        and request.cache_salt is None
        and getattr(request, "prompt_embeds", None) is None
    ):
        return None
    return generate_block_hash_extra_keys(request, start, end, 0)[0]


def config_info(
    num_blocks: int, f: int, block_bytes: int, groups: list, max_model_len: int
) -> tuple[str, ...]:
    """The host tier's static facts, as vLLM 0.34's ``vllm:kv_offload_config_info`` labels
    them: block slots, engine blocks per slot, bytes (``block_bytes``: a block's over every
    worker), and the KV tokens of
    ``max_model_len``-token requests it holds (each needs every block of each attention
    group it spans and one state of each state group)."""
    per_request = sum(
        1 if group.is_state else -(-max_model_len // (group.block_size * f))
        for group in groups
        if group.offloaded
    )
    tokens = num_blocks // per_request * max_model_len if per_request and max_model_len > 0 else 0
    return (str(num_blocks), str(f), str(num_blocks * block_bytes), str(tokens))


class SchedulerSide:
    # calls that may have changed a counter: the metrics are read again only after one
    changes = 0

    def __init__(self, vllm_config: Any, kv_cache_config: KVCacheConfig, config: OffloadConfig) -> None:
        tiers = config.tiers
        groups = kv_groups(vllm_config, kv_cache_config)
        offloaded = [g for g, group in enumerate(groups) if group.offloaded]
        f = tiers.blocks_per_offload_block
        block_bytes = host_block_bytes(kv_cache_config, offloaded, f)  # one worker's share
        # tensor (and pipeline) parallel workers: each holds its share of every block
        self._num_workers = world_size = vllm_config.parallel_config.world_size
        try:
            self.manager = build_manager(
                tiers,
                block_bytes,
                kv_identity(vllm_config, kv_cache_config, offloaded, f),
                world_size=world_size,
            )
        except ValueError as exc:
            raise ValueError(f"kv_connector_extra_config: {exc}") from None
        hash_block_size = kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
        self.scheduler = OffloadingScheduler(
            self.manager,
            groups,
            hash_block_size=hash_block_size,
            blocks_per_offload_block=tiers.blocks_per_offload_block,
            kv_events=config.kv_events,
            null_block_id=NULL_BLOCK_ID,
            store_threshold=config.store_threshold,
            store_threshold_memory=config.store_threshold_memory,
            offload_prompt_only=config.offload_prompt_only,
            block_extra_keys=_extra_keys,
            # vLLM's event classes built directly where they take ours positionally
            event_classes=_VLLM_CLASSES if all(_SAME_FIELDS.values()) else None,
        )
        self.config_info = config_info(
            tiers.num_host_blocks(block_bytes, world_size),
            f,
            block_bytes * world_size,
            groups,
            vllm_config.model_config.max_model_len,
        )
        self._reports: dict[int, tuple[int, bool]] = {}
        # Loads within the step (sync_load_budget_bytes): one worker's bytes per token of a
        # hit; one KV-cache group only (vLLM recomputes a failed one's blocks; with several
        # groups it cannot undo a failed load of a request already running)
        self._sync_budget = config.sync_load_budget_bytes if len(groups) == 1 else 0
        self._bytes_per_token = block_bytes / (groups[0].block_size * f) if len(groups) == 1 else 0.0
        self._sync_requests: set[str] = set()  # this step's, while it is being scheduled
        self._sync_bytes = 0.0
        # what the session controls need of this engine (kvoffload.integrations.vllm.sessions)
        self.media = [self.manager.medium, *(t.medium for t in getattr(self.manager, "secondaries", ()))]
        self.offloaded = offloaded
        self.hash_block_size = hash_block_size
        self.block_tokens = [groups[g].block_size * f for g in offloaded]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, directives: SessionDirectives = NO_DIRECTIVES
    ) -> tuple[int | None, bool]:
        # the request's context gets vLLM's kv_transfer_params as its hints (tiers may read
        # them) and the session directives read from its fields
        self.changes += 1
        tokens = self.scheduler.match(request, num_computed_tokens, request.kv_transfer_params, directives)
        if tokens is None:
            return None, False
        return tokens, tokens > 0 and not self._reserve_sync_load(request.request_id, tokens)

    def _reserve_sync_load(self, req_id: str, tokens: int) -> bool:
        """Whether the hit fits what is left of this step's sync-load budget (reserved if so)."""
        self._sync_requests.discard(req_id)
        size = tokens * self._bytes_per_token
        if not self._sync_budget or self._sync_bytes + size > self._sync_budget:
            return False
        self._sync_bytes += size
        self._sync_requests.add(req_id)
        return True

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self.changes += 1
        self.scheduler.on_allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, out: SchedulerOutput) -> KVOffloadMetadata:
        # Mamba "align" states written this step, with their exact blocks (vLLM hands them
        # over because a state's block table position is not stable)
        block_state = getattr(out, "kv_connector_block_state", None)
        states = dict(block_state.boundary_state_offloads) if block_state is not None else {}
        steps = [
            StepRequest(
                new.req_id,
                new.block_ids,
                new.num_computed_tokens + out.num_scheduled_tokens[new.req_id],
                True,
                states.pop(new.req_id, ()),
            )
            for new in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        # vLLM 0.32/0.33 resume a preempted request among the cached ones with its whole
        # block table (resumed_req_ids); 0.34 sends it among the new ones, whose block
        # tables always replace what was known
        resumed = getattr(cached, "resumed_req_ids", ())
        ids = cached.req_ids
        # every request that ran on (all of a decode step) goes in one RunningRequests,
        # built in one C loop: no Python per request
        computed = tokens_after(ids, cached.num_computed_tokens, out.num_scheduled_tokens)
        if resumed or states:  # (rare) these go as StepRequests
            ran = [req_id not in resumed and req_id not in states for req_id in ids]
            steps += [
                StepRequest(
                    req_id,
                    new_ids,
                    tokens,
                    req_id in resumed,
                    states.pop(req_id, ()),
                )
                for req_id, new_ids, tokens, r in zip(ids, cached.new_block_ids, computed, ran)
                if not r
            ]
            running = RunningRequests(
                list(compress(ids, ran)),
                list(compress(computed, ran)),
                list(compress(cached.new_block_ids, ran)),
            )
        else:
            running = RunningRequests(ids, computed, cached.new_block_ids)
        steps += [StepRequest(req_id, None, 0, states=handed) for req_id, handed in states.items()]
        plan = self.scheduler.build_step(steps, out.preempted_req_ids or (), running)
        if plan.loads or plan.stores or plan.transfers or plan.flush or plan.hold_blocks:
            self.changes += 1
        sync = frozenset(job.job_id for job in plan.loads if job.req_id in self._sync_requests)
        self._sync_requests, self._sync_bytes = set(), 0.0  # the budget is per step
        return KVOffloadMetadata(plan, idle=out.total_num_scheduled_tokens == 0, sync_loads=sync)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVOffloadWorkerMetadata):
            return
        done = []
        for job_id, (count, ok) in meta.finished.items():
            prev_count, prev_ok = self._reports.pop(job_id, (0, True))
            count, ok = prev_count + count, prev_ok and ok
            if count >= self._num_workers:
                done.append((job_id, ok))
            else:
                self._reports[job_id] = (count, ok)
        if done:
            self.changes += 1
            self.scheduler.complete_jobs(done)

    def request_finished(self, request: Request) -> bool:
        self.changes += 1
        return self.scheduler.request_finished(request.request_id)

    def take_events(self) -> Iterable[vllm_events.KVCacheEvent]:
        events = self.scheduler.take_events()
        if events:
            self.changes += 1
        return [e if type(e) in _VLLM_TYPES else to_vllm_event(e) for e in events]

    def reset_cache(self) -> bool:
        self.changes += 1
        try:
            self.scheduler.reset()
        except RuntimeError:
            return False
        return True


_VLLM_CLASSES = {
    kv_types.BlockStored: vllm_events.BlockStored,
    kv_types.BlockRemoved: vllm_events.BlockRemoved,
    kv_types.AllBlocksCleared: vllm_events.AllBlocksCleared,
}


def _positional(ours: type, theirs: type) -> bool:
    """Whether vLLM's class starts with our fields in our order, any further field having
    a default (0.34's ``BlockStored`` adds ``lookahead_token_ids``)."""
    mine, its = ours.__struct_fields__, theirs.__struct_fields__
    extra = len(its) - len(mine)
    return its[: len(mine)] == mine and extra <= len(theirs.__struct_defaults__)


# Classes whose fields start as vLLM's, in vLLM's order, convert positionally (a store of
# 62 blocks is 62 events on the engine's step: 4.3 us each by keywords, 0.2 us so).
_SAME_FIELDS = {ours: _positional(ours, theirs) for ours, theirs in _VLLM_CLASSES.items()}
_VLLM_TYPES = frozenset(_VLLM_CLASSES.values())


def to_vllm_event(event: kv_types.KVCacheEvent) -> vllm_events.KVCacheEvent:
    """The same event as an instance of vLLM's class, field for field."""
    cls = _VLLM_CLASSES[type(event)]
    if _SAME_FIELDS[type(event)]:
        return cls(*msgspec.structs.astuple(event))
    fields = set(cls.__struct_fields__)
    return cls(**{k: v for k, v in msgspec.structs.asdict(event).items() if k in fields})
