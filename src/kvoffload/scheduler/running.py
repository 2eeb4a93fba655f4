"""A step's stores planned in one pass: the block-completion step of lockstep decoding.

When a thousand requests decode in lockstep, one step in ``tokens per block`` completes a
block of every one of them. Planning those request by request (``Stores._offer``: candidate
tuples, an offer each, then flattened again for the one reservation) costs more than the
step's every other part. Where every request's blocks are one KV-cache group's, one device
block per offloaded block, and no reuse filter counts them (``_flat_group`` says which
group, ``None`` otherwise), the step's offers are kept flat instead (``Flat``: keys, device
blocks, block indices, and per request its span of them), the running requests that reached
a block end are planned inline, and where the tier reserves every key as asked the job,
its per-request parts and the records of its ``BlockStored`` events are built from the
flat lists in one pass.

Contract: exactly the plan, job ids, tier calls, records and events of planning each
request with ``_offer`` and reserving them with ``_store_jobs`` (``batch_stores = False``
keeps that path; ``tests/scheduler/test_flat_stores.py`` compares the two step by step).
Anything else (fewer than two requests with blocks, a tier that cannot take them all, keys
already present) goes through that path with the same offers.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.scheduler.base import SchedulerBase
from kvoffload.scheduler.blocks import device_spec
from kvoffload.scheduler.state import RequestState
from kvoffload.scheduler.types import TransferJob

_NEVER = float("inf")


def _one(block: int) -> list[int]:
    return [block]


class Flat:
    """A step's offers, flat: ``keys[i]`` is offloaded block ``blocks[i]`` of the group,
    held in device block ``device[i]``; ``owners`` lists ``(req_id, state, hashes, count)``,
    each request's ``count`` entries in order after the previous one's."""

    __slots__ = ("keys", "device", "blocks", "owners")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.device: list[int] = []
        self.blocks: list[int] = []
        self.owners: list[tuple[str, RequestState, object, int]] = []


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
        for req_id, computed in reached:
            state = requests[req_id]
            request = state.request
            hashes = request.block_hashes
            if hashes is None:  # hashed here: the full path
                self._add_offer(flat, self._offer(req_id, state, computed))
                continue
            prompt = request.num_prompt_tokens
            complete = (prompt if prompt_only and computed > prompt else computed) // tokens
            if volatile and computed > prompt:
                complete -= 1  # a draft layer's last block is rewritten until the next one is
            stored = state.stored_blocks
            start = stored[g]
            ids = state.block_ids[g]
            end = min(complete, len(hashes) // step, len(ids))
            if end > start:
                known = state.keys[g]
                if len(known) < end:
                    last = hashes[end * step - 1]
                    if len(known) == end - 1 and type(last) is bytes:  # (a decode step's one block)
                        known.append(last + suffix)
                    else:
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
            store_at[req_id] = _NEVER if prompt_only and bound > request.num_prompt_tokens else bound

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
        keys, owners = flat.keys, flat.owners
        if len(owners) < 2:
            return self._store_jobs(self._offers(flat))
        out = self.manager.prepare_store(keys)
        if out is None:
            return [job for job in map(self._own_job, self._offers(flat)) if job is not None]
        if out.keys_to_store != keys:  # some present already (or offered twice): pick
            return self._picked_job(out, [(c, offer) for offer in self._offers(flat) for c in offer[3]])
        g = self._flat_group()
        tokens = self._tokens[g]
        step = tokens // self.hash_block_size
        extra_keys = self._extra_keys
        blocks = flat.blocks
        parts: list[tuple[str, list[OffloadKey]]] = []
        records = []  # what each key's BlockStored says (``EventConverter.remember``)
        at = 0
        for req_id, state, hashes, count in owners:
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
            at = end
        self._events.remember_all(keys, records)
        sizes = [0] * len(self.groups)
        indices = [0] * len(self.groups)
        sizes[g], indices[g] = len(keys), blocks[0]
        job = self._new_job("", True, keys)
        self._jobs[job].parts = parts
        for _, state, _, _ in owners:
            state.jobs.add(job)
        return [TransferJob(job, "", True, device_spec(flat.device, sizes, indices), out.store_spec)]
