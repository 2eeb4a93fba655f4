"""A step's stores planned in one pass: the block-completion step of lockstep decoding.

When a thousand requests decode in lockstep, one step in ``tokens per block`` completes a
block of every one of them. Planning those request by request (``Stores._offer``: candidate
tuples, an offer each, then flattened again for the one reservation) costs more than the
step's every other part. Where every request's blocks are one KV-cache group's, one device
block per offloaded block, and no reuse filter counts them (``_flat_group`` says which
group, ``None`` otherwise), the step's offers are kept flat instead (``Flat``: keys, device
blocks, block indices, and per request its span of them), the running requests that reached
a block end are planned inline (for each one offering one block, what its ``BlockStored``
will say recorded as it is planned, while the request is at hand), and where the tier
reserves every key as asked the job and its per-request parts are built from the flat lists
in one pass.

Contract: exactly the plan, job ids, tier calls, records and events of planning each
request with ``_offer`` and reserving them with ``_store_jobs`` (``batch_stores = False``
keeps that path; ``tests/scheduler/test_flat_stores.py`` compares the two step by step).
Anything else (fewer than two requests with blocks, a tier that cannot take them all, keys
already present) goes through that path with the same offers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter

from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.scheduler.base import SchedulerBase
from kvoffload.scheduler.blocks import device_spec
from kvoffload.scheduler.state import RequestState
from kvoffload.scheduler.types import TransferJob

_NEVER = float("inf")
_JOBS = attrgetter("jobs")


def _one(block: int) -> list[int]:
    return [block]


class Flat:
    """A step's offers, flat: ``keys[i]`` is offloaded block ``blocks[i]`` of the group,
    held in device block ``device[i]``; ``owners`` lists ``(req_id, state, hashes, count)``,
    each request's ``count`` entries in order after the previous one's.

    While every request offers one block, planned inline (a decode step's), it is kept as
    ``req_ids[i]``, ``states[i]`` and ``records[i]`` (what the ``BlockStored`` of ``keys[i]``
    says, made while the request is at hand) instead of in ``owners``; ``general()`` leaves
    that form (those three ``None``)."""

    __slots__ = ("keys", "device", "blocks", "owners", "req_ids", "states", "records")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.device: list[int] = []
        self.blocks: list[int] = []
        self.owners: list[tuple[str, RequestState, object, int]] = []
        self.req_ids: list[str] | None = []
        self.states: list[RequestState] | None = []
        self.records: list | None = []

    def general(self) -> None:
        """``owners`` of every offer so far, from here on."""
        if self.records is not None:
            self.owners += [
                (req_id, state, state.request.block_hashes, 1)
                for req_id, state in zip(self.req_ids, self.states)
            ]
            self.req_ids = self.states = self.records = None


class RunningStores(SchedulerBase):
    """The flat form of a step's store planning (part of ``Stores``)."""

    # False: every step's stores planned request by request (the reference path)
    batch_stores = True

    def _flat_group(self) -> int | None:
        """The group whose blocks the flat form plans now, or ``None`` (request by request)."""
        if (
            not self.batch_stores
            or self.blocks_per_offload_block != 1
            or len(self._block_groups) != 1
            or len(self._offloaded) != 1
            or self._reuse.active
        ):
            return None
        return self._block_groups[0][0]

    def _add_offer(self, flat: Flat, offer) -> None:
        """A request's offer from ``_offer``, appended to the flat lists."""
        req_id, state, hashes, candidates = offer
        if candidates:
            flat.keys += [c[2] for c in candidates]
            flat.device += [c[3][0] for c in candidates]
            flat.blocks += [c[1] for c in candidates]
            flat.general()
            flat.owners.append((req_id, state, hashes, len(candidates)))

    def _offer_running(self, flat: Flat, reached: Iterable[tuple[str, int]]) -> None:
        """``_offer`` of each ``(req_id, computed tokens)`` (requests that only ran and
        reached their next store bound), inline, appended to ``flat``."""
        g, tokens, volatile = self._block_groups[0]
        step = tokens // self.hash_block_size
        null = self.null_block_id
        prompt_only = self.offload_prompt_only
        requests = self._requests
        store_at = self._store_at
        make_keys = self._blocks.keys
        suffix = make_offload_key(b"", g)  # (what ``make_offload_key`` appends for the group)
        keys, device, blocks, owners = flat.keys, flat.device, flat.blocks, flat.owners
        extra_keys = self._extra_keys
        req_ids, states, records = flat.req_ids, flat.states, flat.records
        single = records is not None  # every request one block so far (``Flat``)
        for req_id, computed in reached:
            state = requests[req_id]
            request = state.request
            hashes = request.block_hashes
            if hashes is None:  # hashed here: the full path
                flat.general()
                single = False
                self._add_offer(flat, self._offer(req_id, state, computed))
                continue
            if prompt_only or volatile:  # (else its prompt's length is not read: memory)
                prompt = request.num_prompt_tokens
                complete = (prompt if prompt_only and computed > prompt else computed) // tokens
                if volatile and computed > prompt:
                    complete -= 1  # a draft layer's last block is rewritten until the next one is
            else:
                complete = computed // tokens
            stored = state.stored_blocks
            start = stored[g]
            ids = state.block_ids[g]
            if complete == start + 1 and complete * step <= len(hashes) and complete <= len(ids):
                end = complete  # (a decode step's one block: no slices, no ranges)
                known = state.keys[g]
                if len(known) == start and type(last := hashes[end * step - 1]) is bytes:
                    key = last + suffix
                    known.append(key)
                else:
                    if len(known) < end:
                        known += make_keys(hashes, g, len(known), end)
                    key = known[start]
                stored[g] = end
                block = ids[start]
                loaded = state.loaded_range
                if block != null and not (loaded and loaded[g][0] <= start < loaded[g][1]):
                    keys.append(key)
                    device.append(block)
                    blocks.append(start)
                    if single:  # (with what ``_store_flat`` records, while the request is at hand)
                        req_ids.append(req_id)
                        states.append(state)
                        first, stop = start * tokens, end * tokens
                        parent = hashes[start * step - 1] if start else None
                        extra = extra_keys(request, first, stop)
                        records.append((parent, request.all_token_ids, first, stop, extra))
                    else:
                        owners.append((req_id, state, hashes, 1))
            elif (end := min(complete, len(hashes) // step, len(ids))) > start:
                if single:
                    flat.general()
                    single = False
                known = state.keys[g]
                if len(known) < end:
                    known += make_keys(hashes, g, len(known), end)
                stored[g] = end
                before = len(keys)
                lo, hi = state.loaded_range[g] if state.loaded_range else (0, 0)
                for a, b in ((start, min(end, lo)), (max(start, hi), end)) if lo < hi else ((start, end),):
                    if a >= b:
                        continue
                    part = ids[a:b]
                    if null not in part:
                        keys += known[a:b]
                        device += part
                        blocks += range(a, b)
                        continue
                    for j in range(a, b):
                        if ids[j] != null:
                            keys.append(known[j])
                            device.append(ids[j])
                            blocks.append(j)
                if len(keys) > before:
                    owners.append((req_id, state, hashes, len(keys) - before))
            bound = (stored[g] + 1) * tokens
            store_at[req_id] = _NEVER if prompt_only and bound > prompt else bound

    def _offers(self, flat: Flat) -> list:
        """The flat lists as ``_offer``'s offers again, request by request."""
        g = self._flat_group()
        offers, at = [], 0
        for req_id, state, hashes, count in flat.owners:
            end = at + count
            candidates = list(
                zip(repeat(g), flat.blocks[at:end], flat.keys[at:end], map(_one, flat.device[at:end]))
            )
            offers.append((req_id, state, hashes, candidates))
            at = end
        return offers

    def _store_flat(self, flat: Flat) -> list[TransferJob]:
        """``_store_jobs`` of the flat offers: one reservation, one job."""
        keys = flat.keys
        if len(flat.owners if flat.records is None else flat.records) < 2:
            flat.general()
            return self._store_jobs(self._offers(flat))
        out = self.manager.prepare_store(keys)
        if out is None:
            flat.general()
            return [job for job in map(self._own_job, self._offers(flat)) if job is not None]
        if out.keys_to_store != keys:  # some present already (or offered twice): pick
            flat.general()
            return self._picked_job(out, [(c, offer) for offer in self._offers(flat) for c in offer[3]])
        g = self._flat_group()
        blocks = flat.blocks
        # what each key's BlockStored says (``EventConverter.remember``), and each request's part
        if flat.records is not None:  # (made by ``_offer_running``)
            records, states = flat.records, flat.states
            parts = list(zip(flat.req_ids, map(_one, keys)))
        else:
            tokens = self._tokens[g]
            step = tokens // self.hash_block_size
            extra_keys = self._extra_keys
            parts, records, states = [], [], []
            at = 0
            for req_id, state, hashes, count in flat.owners:
                end = at + count
                request = state.request
                token_ids = request.all_token_ids
                for j in blocks[at:end]:
                    first = j * tokens
                    records.append(
                        (
                            hashes[j * step - 1] if j else None,
                            token_ids,
                            first,
                            first + tokens,
                            extra_keys(request, first, first + tokens),
                        )
                    )
                parts.append((req_id, keys[at:end]))
                states.append(state)
                at = end
        self._events.remember_all(keys, records)
        sizes = [0] * len(self.groups)
        indices = [0] * len(self.groups)
        sizes[g], indices[g] = len(keys), blocks[0]
        job = self._new_job("", True, keys)
        self._jobs[job].parts = parts
        deque(map(set.add, map(_JOBS, states), repeat(job)), 0)  # (each request counts it)
        return [TransferJob(job, "", True, device_spec(flat.device, sizes, indices), out.store_spec)]
