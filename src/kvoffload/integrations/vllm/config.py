"""``kv_connector_extra_config`` of ``KVOffloadConnector``, validated.

Keys:

* ``cpu_bytes_to_use`` (required): host bytes for the CPU tier, a positive int.
* ``block_size``: offloaded block size in tokens, a positive multiple of the engine's block
  size (default: the engine's).
* ``eviction_policy``: ``lru`` (default), ``arc``, any registered policy name, or a
  ``package.module:ClassName`` path.
* ``kv_events``: ``self_describing`` (default: ``BlockStored`` with tokens and parent) or
  ``placeholder`` (vLLM's own offloading form: ``block_size=0``, no tokens).
* ``secondary_tiers``: tiers below the CPU tier, as vLLM 0.32 configures them:
  ``[{"type": "fs", "root_dir": "/path", "bytes_to_use": N, ...}]`` (see
  ``kvoffload.tiers.secondary``; out-of-tree tiers by ``"package.module:ClassName"``).
* ``store_threshold``: store a block only once this many requests asked for it, a
  positive int (default 1: store every block; vLLM 0.32's key of the same name).
* ``fault_injection``: off by default. For tests and drills, a mapping that makes chosen
  loads and stores fail (``kvoffload.faults``): ``{"seed": 1, "load_failure_rate": 0.1,
  "store_failure_rate": 0.1, "fail_loads": [...], "fail_stores": [...]}`` (rates in
  [0, 1], positions are 0-based among loads / stores).
* ``switch_interval_s``: the most seconds kvoffload's I/O threads may wait for the GIL
  while the engine's Python loop holds it (``sys.setswitchinterval``, lowered to this at
  start-up when higher; default 0.0002; 0 leaves the interpreter's setting). vLLM's
  engine loop spins on its scheduler while a request waits for a promotion from a lower
  tier; at the interpreter's default of 5 ms, every socket or file call of a transfer
  thread paid that wait (``bench/bench_tier_ttft.py``).
* ``offload_prompt_only``: store only blocks of prompt tokens (vLLM 0.32's key), default
  false: unlike vLLM's connector (default true), kvoffload also stores the blocks an answer
  fills, so the next turn of a conversation finds its whole history offloaded.
* Keys of vLLM's own ``OffloadingConnector`` taken as they mean the same:
  ``blocks_per_chunk`` (``block_size`` in engine blocks), ``self_describing_kv_events``
  (true: ``kv_events="self_describing"``, false: ``"placeholder"``), ``max_tracker_size``
  (the keys the ``store_threshold`` filter remembers). ``spec_name``,
  ``spec_module_path``, ``cache_policy_module_path`` and ``canonical_layout`` are refused
  with a one-line hint (``VLLM_ONLY_KEYS``).
* ``sync_stores``: ``"auto"`` (default), ``true`` or ``false``: whether a step waits for
  the device-to-host copies of the stores it started before it returns. ``auto`` waits
  when the engine's KV cache is in host memory (vLLM's CPU build): there the copies run on
  the cores the engine computes with, and a copy left running competed with the next
  request (an engine-cache hit right after a cold prompt took 12% longer to its first
  token); waiting instead costs the storing request about the copy's time (~1-2 ms per
  15 MiB here). On a GPU the copies overlap compute, and ``auto`` never waits.

* ``sync_load_budget_bytes`` (vLLM 0.34's key): a hit of at most this many bytes (one
  worker's, over the step's hits together) is loaded within the step that schedules its
  request, before the forward pass, instead of one scheduler round trip later; larger
  hits load asynchronously. Default ``DEFAULT_SYNC_LOAD_BUDGET_BYTES``; 0 turns it off.
  Models with one KV-cache group only: vLLM cannot undo a failed load of a request
  already running on a model with several (it recomputes one-group blocks).

Every error is a ``ValueError`` whose message names the key and the bad value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.faults import FaultConfig
from kvoffload.scheduler.events import EVENT_MODES
from kvoffload.scheduler.reuse import DEFAULT_MEMORY
from kvoffload.tiers.factory import TierConfig
from kvoffload.tiers.secondary import parse_secondary_tiers
from kvoffload.validation import non_negative_int, positive_int

DEFAULT_SWITCH_INTERVAL_S = 0.0002
DEFAULT_IDLE_WAIT_S = 0.001
DEFAULT_SYNC_LOAD_BUDGET_BYTES = 16 << 20

KNOWN_KEYS = (
    "cpu_bytes_to_use",
    "block_size",
    "eviction_policy",
    "kv_events",
    "secondary_tiers",
    "store_threshold",
    "fault_injection",
    "switch_interval_s",
    "sync_stores",
    "idle_wait_s",
    "offload_prompt_only",
    "blocks_per_chunk",
    "self_describing_kv_events",
    "max_tracker_size",
    "sync_load_budget_bytes",
)

# vLLM OffloadingConnector keys with no kvoffload meaning -> what to do instead
VLLM_ONLY_KEYS = {
    "spec_name": "kvoffload builds its own tiers: remove it (tiers of your own go in "
    "secondary_tiers as {'type': 'package.module:ClassName'})",
    "spec_module_path": "kvoffload builds its own tiers: remove it (tiers of your own go in "
    "secondary_tiers as {'type': 'package.module:ClassName'})",
    "cache_policy_module_path": "give the policy as eviction_policy='package.module:ClassName'",
    "canonical_layout": "kvoffload keeps blocks in the engine's own page layout: remove it",
}


@dataclass(frozen=True)
class OffloadConfig:
    """The tiers to build (``kvoffload.tiers.factory``), the form of their KV events, and
    the scheduler's reuse filter (``store_threshold``)."""

    tiers: TierConfig
    kv_events: str
    store_threshold: int = 1
    faults: FaultConfig | None = None  # fault_injection: None = off
    switch_interval_s: float = DEFAULT_SWITCH_INTERVAL_S
    sync_stores: str | bool = "auto"
    idle_wait_s: float = DEFAULT_IDLE_WAIT_S
    offload_prompt_only: bool = False
    store_threshold_memory: int = DEFAULT_MEMORY
    sync_load_budget_bytes: int = DEFAULT_SYNC_LOAD_BUDGET_BYTES


def _positive_int(extra: Mapping[str, Any], key: str) -> int:
    return positive_int(f"kv_connector_extra_config[{key!r}]", extra[key])


def _short_seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    """``extra[key]`` (or ``default``): a number of seconds in [0, 0.1]."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 0.1:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be seconds in [0, 0.1], got {value!r}")
    return float(value)


def parse_extra_config(extra: Mapping[str, Any] | None, engine_block_size: int) -> OffloadConfig:
    """Validate ``extra`` against an engine whose device blocks hold ``engine_block_size`` tokens."""
    extra = dict(extra or {})
    for key in sorted(set(extra) & set(VLLM_ONLY_KEYS)):
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] is vLLM's OffloadingConnector's: {VLLM_ONLY_KEYS[key]}"
        )
    unknown = sorted(set(extra) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; known: {list(KNOWN_KEYS)}")
    if "cpu_bytes_to_use" not in extra:
        raise ValueError(
            "kv_connector_extra_config['cpu_bytes_to_use'] is required (host bytes for the CPU tier)"
        )
    cpu_bytes = _positive_int(extra, "cpu_bytes_to_use")
    block_size = engine_block_size
    if "blocks_per_chunk" in extra:
        chunk = _positive_int(extra, "blocks_per_chunk") * engine_block_size
        if extra.setdefault("block_size", chunk) != chunk:
            raise ValueError(
                f"kv_connector_extra_config['blocks_per_chunk'] ({extra['blocks_per_chunk']} engine blocks: "
                f"{chunk} tokens) disagrees with block_size={extra['block_size']!r}"
            )
    if "block_size" in extra:
        block_size = _positive_int(extra, "block_size")
        if block_size % engine_block_size:
            raise ValueError(
                f"kv_connector_extra_config['block_size'] must be a multiple of the engine block size "
                f"{engine_block_size}, got {block_size}"
            )
    store_threshold = _positive_int(extra, "store_threshold") if "store_threshold" in extra else 1
    if "self_describing_kv_events" in extra:
        flag = _bool(extra, "self_describing_kv_events", True)
        events = "self_describing" if flag else "placeholder"
        if extra.setdefault("kv_events", events) != events:
            raise ValueError(
                f"kv_connector_extra_config['self_describing_kv_events']={flag!r} disagrees with "
                f"kv_events={extra['kv_events']!r}"
            )
    events = extra.get("kv_events", "self_describing")
    if events not in EVENT_MODES:
        raise ValueError(
            f"kv_connector_extra_config['kv_events'] must be one of {list(EVENT_MODES)}, got {events!r}"
        )
    try:
        tiers = TierConfig(
            cpu_bytes,
            block_size // engine_block_size,
            extra.get("eviction_policy", "lru"),
            parse_secondary_tiers(extra.get("secondary_tiers", [])),
        )
    except ValueError as exc:
        raise ValueError(f"kv_connector_extra_config: {exc}") from None
    faults = None
    if extra.get("fault_injection") is not None:
        faults = FaultConfig.parse(extra["fault_injection"], "kv_connector_extra_config['fault_injection']")
    interval = _short_seconds(extra, "switch_interval_s", DEFAULT_SWITCH_INTERVAL_S)
    sync = extra.get("sync_stores", "auto")
    if not (isinstance(sync, bool) or sync == "auto"):
        raise ValueError(
            f"kv_connector_extra_config['sync_stores'] must be 'auto', true or false, got {sync!r}"
        )
    idle_wait = _short_seconds(extra, "idle_wait_s", DEFAULT_IDLE_WAIT_S)
    prompt_only = _bool(extra, "offload_prompt_only", False)
    memory = _positive_int(extra, "max_tracker_size") if "max_tracker_size" in extra else DEFAULT_MEMORY
    budget = extra.get("sync_load_budget_bytes", DEFAULT_SYNC_LOAD_BUDGET_BYTES)
    non_negative_int("kv_connector_extra_config['sync_load_budget_bytes']", budget)
    return OffloadConfig(
        tiers, events, store_threshold, faults, interval, sync, idle_wait, prompt_only, memory, budget
    )


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value
