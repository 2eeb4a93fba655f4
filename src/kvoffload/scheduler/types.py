"""Plain data exchanged between an engine and the ``OffloadingScheduler``.

Engines describe their KV-cache groups (``KVGroup``), each step's scheduled requests
(``StepRequest``) and transfer outcomes (``(job_id, success)`` pairs); the scheduler answers
with ``TransferJob``s gathered in a ``StepPlan``. Nothing here depends on an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvoffload.keys import block_extra_keys
from kvoffload.specs import LoadStoreSpec
from kvoffload.validation import positive_int


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group of the engine: its device block size in tokens.

    ``kind`` and ``sliding_window`` are reported in ``BlockStored`` events so routers can
    tell groups apart; offloading keeps every block of a group that is not the null block,
    except for ``kind="mamba"``: a group of recurrent states, where device block ``i`` holds
    the state after ``(i + 1) * block_size`` tokens and only one state is needed to resume
    (offloaded block ``j`` is the state after its last token; a hit must end on a stored
    state; the engine names the states it writes in ``StepRequest.states``).
    ``offloaded=False``: a group the engine does not transfer (its blocks are neither
    stored nor loaded, and it does not bound a hit). ``volatile_tail``: the group's last
    whole block may still change while the request decodes (EAGLE/MTP draft layers), so it
    is stored only once a further block is complete.
    """

    block_size: int
    kind: str = "full_attention"
    sliding_window: int | None = None
    offloaded: bool = True
    volatile_tail: bool = False

    def __post_init__(self) -> None:
        positive_int("KVGroup.block_size", self.block_size)

    @property
    def is_state(self) -> bool:
        return self.kind == STATE_KIND


STATE_KIND = "mamba"


class RequestView(Protocol):
    """What the scheduler reads from an engine request; the sequences may grow over time."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> Sequence[bytes] | None: ...

    @property
    def num_prompt_tokens(self) -> int: ...


# (request, start, end) -> the extra keys the engine hashes into tokens [start, end)
BlockExtraKeys = Callable[[Any, int, int], "tuple[Any, ...] | None"]


def view_extra_keys(request: Any, start: int, end: int) -> tuple[Any, ...] | None:
    """The extra keys of a block of ``request`` from the optional attributes an engine's
    request view may have: ``cache_salt``, ``lora_name`` with ``lora_path``, and
    ``mm_features`` (``kvoffload.keys.MMPlaceholder``s); ``None`` without any."""
    lora_name = getattr(request, "lora_name", None)
    return block_extra_keys(
        start,
        end,
        cache_salt=getattr(request, "cache_salt", None),
        lora_name=lora_name,
        lora_path=getattr(request, "lora_path", None) if lora_name is not None else None,
        mm_features=getattr(request, "mm_features", None) or (),
    )


@dataclass(frozen=True)
class StepRequest:
    """A request scheduled in this step.

    ``new_block_ids`` (one list per KV-cache group, or ``None``) are appended to the
    request's device blocks, or replace them when ``replace_block_ids`` (a resumed request).
    ``num_computed_tokens`` counts the tokens whose KV exists once this step has run.
    ``states``: ``(group, device block id, tokens)`` for each state of a ``"state"``
    group (Mamba) this step writes: the block holds the state after exactly ``tokens``.
    """

    req_id: str
    new_block_ids: Sequence[Sequence[int]] | None
    num_computed_tokens: int
    replace_block_ids: bool = False
    states: Sequence[tuple[int, int, int]] = ()


@dataclass(frozen=True)
class RunningRequests:
    """The requests of a step that ran on (no states, no replaced block table), as
    parallel lists: ``computed[i]`` counts the tokens whose KV ``req_ids[i]`` has once this
    step has run; ``new_block_ids[i]`` (if given) is ``None`` or, per KV-cache group, the
    device blocks appended to its table. The cheap form of their ``StepRequest``s for the
    bulk of a decode step."""

    req_ids: Sequence[str]
    computed: Sequence[int]
    new_block_ids: Sequence[Sequence[Sequence[int]] | None] | None = None

    def __post_init__(self) -> None:
        counts = {len(self.req_ids), len(self.computed)}
        if self.new_block_ids is not None:
            counts.add(len(self.new_block_ids))
        if len(counts) > 1:
            raise ValueError(
                f"RunningRequests: {len(self.req_ids)} request ids, {len(self.computed)} computed counts"
                + ("" if self.new_block_ids is None else f", {len(self.new_block_ids)} new block lists")
            )


@dataclass(frozen=True)
class TransferJob:
    """One copy for the worker: ``src_spec`` to ``dst_spec``, reported back by ``job_id``.
    ``req_id`` is ``""`` for a copy between tiers and for a store of several requests'
    blocks."""

    job_id: int
    req_id: str
    is_store: bool
    src_spec: LoadStoreSpec
    dst_spec: LoadStoreSpec


@dataclass
class StepPlan:
    """What the worker does this step.

    Loads run before the forward pass, stores after it. ``transfers`` move blocks between
    tiers (write-through, promotion; ``req_id`` is ``""``): they may start at any time and
    touch no device block. ``hold_blocks`` names finished
    requests whose device blocks the engine must keep until the listed jobs complete.
    ``flush`` names preempted requests whose jobs must complete before their blocks are
    reused.
    """

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    transfers: list[TransferJob] = field(default_factory=list)
    hold_blocks: dict[str, list[int]] = field(default_factory=dict)
    flush: dict[str, list[int]] = field(default_factory=dict)
