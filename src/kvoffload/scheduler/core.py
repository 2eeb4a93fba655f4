"""The engine-agnostic offloading scheduler: which blocks to load and store, each step.

Single-threaded and non-blocking: it only does bookkeeping on an ``OffloadingManager`` and
hands out ``TransferJob``s; the worker side moves the bytes and reports ``(job_id,
success)`` back through ``complete_jobs``.

Blocks. Each KV-cache group ``g`` has a device block size ``B_g``; an offloaded block spans
``F = blocks_per_offload_block`` device blocks, ``T_g = B_g * F`` tokens. The engine's
request hashes are chained hashes of ``hash_block_size``-token blocks; offloaded block
``j`` of group ``g`` is keyed by the hash that ends at token ``(j + 1) * T_g`` (a chained
hash names its whole prefix) and the group index. Only whole offloaded blocks are
offloaded; the trailing partial block never is. Device blocks equal to ``null_block_id``
(what engines put outside a sliding window) are never stored or loaded.

Request lifecycle, one part each (the steps' contracts are in their modules):

1. ``match`` and 2. ``on_allocated``: ``kvoffload.scheduler.loads``.
3. ``build_step``: ``kvoffload.scheduler.stores``.
4. ``complete_jobs`` and 5. ``request_finished``, ``take_freeable``, with ``take_events``
   and ``reset``: ``kvoffload.scheduler.completion``.

The configuration and the tables they share: ``kvoffload.scheduler.base``.

Tenants: the engine's block hashes already hold what keeps tenants apart (cache salt,
LoRA adapter, multimodal items), so keys taken from them never mix two tenants' blocks.
For an engine that does not hash, the scheduler hashes the tokens with the request's
extra keys (``block_extra_keys``); those also fill ``BlockStored.extra_keys``.
"""

from __future__ import annotations

from kvoffload.scheduler.completion import Completion
from kvoffload.scheduler.loads import Loads
from kvoffload.scheduler.stores import Stores


class OffloadingScheduler(Loads, Stores, Completion):
    """Plans loads and stores between an engine's device blocks and one offloading tier."""
