"""``kv_connector_extra_config`` of ``KVOffloadConnector``, validated.

Every key is declared once, in ``EXTRA_CONFIG`` below (its kind of value, default and
meaning; README's extra-config table is generated from it by
``scripts/config_tables.py``); the keys of a ``secondary_tiers`` entry are in each tier
type's own table (``kvoffload.tiers.fs.tier.FS_KEYS``, ``kvoffload.tiers.redis.tier.REDIS_KEYS``).
The rules over several keys are code in ``parse_extra_config``: ``blocks_per_chunk`` and
``self_describing_kv_events`` (vLLM's ``OffloadingConnector`` keys) must agree with
``block_size`` and ``kv_events`` when both are given, ``block_size`` is a multiple of the
engine's, and vLLM's keys with no kvoffload meaning are refused with a hint
(``VLLM_ONLY_KEYS``). ``fault_injection`` has its own parser (``kvoffload.faults``).

Parsing has no side effects: the tiers touch their folders, servers and secrets only when
they are built. Every error is a ``ValueError`` whose message names the key and the bad value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.control.server import tenant_scopes
from kvoffload.faults import FaultConfig
from kvoffload.scheduler.events import EVENT_MODES
from kvoffload.scheduler.reuse import DEFAULT_MEMORY
from kvoffload.settings import (
    BOOL,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    REQUIRED,
    Key,
    Kind,
    Schema,
    custom,
    one_of,
    seconds,
    text,
)
from kvoffload.tiers.factory import (
    EVICTION_POLICY,
    PREFETCH_BATCH,
    PREFETCH_IN_FLIGHT,
    RETENTION_FRACTION,
    TierConfig,
)
from kvoffload.tiers.secondary import parse_secondary_tiers

DEFAULT_SWITCH_INTERVAL_S = 0.0002
DEFAULT_IDLE_WAIT_S = 0.001
DEFAULT_SYNC_LOAD_BUDGET_BYTES = 16 << 20
DEFAULT_CONTROL_HOST = "127.0.0.1"
DEFAULT_CONTROL_TIMEOUT_S = 5.0
PORT = Kind(
    "int in [0, 65535]",
    "be a port number in [0, 65535]",
    lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 65535,
)


def _tiers(where: str, value: Any) -> tuple:
    try:
        return parse_secondary_tiers(value)
    except ValueError as exc:
        raise ValueError(f"kv_connector_extra_config: {exc}") from None


def _faults(where: str, value: Any) -> FaultConfig | None:
    return None if value is None else FaultConfig.parse(value, where)


def _tenant_tokens(where: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping of tenant (cache_salt) to token, got {value!r}")
    for tenant, token in value.items():
        if not isinstance(tenant, str):
            raise ValueError(f"{where}: a tenant must be a string (a cache_salt), got {tenant!r}")
        if not isinstance(token, str) or not token:
            raise ValueError(f"{where}[{tenant!r}] must be a non-empty string token, got {token!r}")
    return dict(value)


_VLLM_KEY = "vLLM's `OffloadingConnector` key, taken as it means the same: "

EXTRA_CONFIG = Schema((
    Key("cpu_bytes_to_use", POSITIVE_INT, REQUIRED,
        "host bytes for the CPU tier, the total over all workers as in vLLM: with tensor parallelism each of "
        "the N workers holds its share of every block in `cpu_bytes_to_use / N`",
        hint="host bytes for the CPU tier"),
    Key("block_size", POSITIVE_INT, None,
        "offloaded block size in tokens, a multiple of the engine's block size",
        shown_default="the engine's"),
    EVICTION_POLICY,
    Key("kv_events", one_of(*EVENT_MODES), "self_describing",
        "`self_describing` (`BlockStored` with `token_ids`, parent hash, `block_size`) or `placeholder` "
        "(vLLM's own offloading form: `block_size=0`, no tokens)"),
    Key("secondary_tiers", custom("list of tier entries", _tiers), (),
        "tiers below the CPU tier, fastest first, vLLM 0.32's shape: `[{\"type\": \"fs\", \"root_dir\": "
        '"/nvme/kv", "bytes_to_use": 500 << 30}, {"type": "redis", "url": "redis://10.0.0.5:6379/0"}]` '
        '(their keys: the tables below); out-of-tree tiers as `"type": "package.module:ClassName"`',
        shown_default="none"),
    Key("store_threshold", POSITIVE_INT, 1,
        "store a block only once this many requests have asked for it (vLLM 0.32's key); blocks held back "
        "are counted in `skipped_stores`",
        shown_default="`1` (store every block)"),
    Key("fault_injection", custom("mapping", _faults), None,
        'for tests and drills: make loads and stores fail, seeded (`kvoffload.faults`): `{"seed": 1, '
        '"load_failure_rate": 0.1, "store_failure_rate": 0.1}` (rates in [0, 1]), or exact positions '
        '`"fail_loads": [0, 5]`, `"fail_stores": [...]` (0-based among loads / stores). A failed job first '
        "copies from the wrong blocks, then reports failure",
        shown_default="off"),
    Key("switch_interval_s", seconds(0, 0.1), DEFAULT_SWITCH_INTERVAL_S,
        "the interpreter's GIL switch interval is lowered to this at start-up (`sys.setswitchinterval`; 0 "
        "leaves it): vLLM's engine loop spins while a request waits for a promotion, and at Python's "
        "default of 5 ms each socket or file call of kvoffload's transfer threads waited that long for the "
        "GIL"),
    Key("sync_stores", one_of("auto", True, False, must="be 'auto', true or false"), "auto",
        "whether a step waits for the device-to-host copies of the stores it started before it returns. "
        "`auto` waits when the engine's KV cache is in host memory (vLLM's CPU build): there a copy left "
        "running competed with the next request for the cores (an engine-cache hit right after a cold "
        "prompt took 12% longer to its first token), and waiting costs the storing request about the "
        "copy's time (~1-2 ms per 15 MiB); on a GPU the copies overlap compute and `auto` never waits"),
    Key("idle_wait_s", seconds(0, 0.1), DEFAULT_IDLE_WAIT_S,
        "in a step that schedules no tokens (no forward pass runs), the worker side first waits up to this "
        "long for its loads and tier promotions in flight instead of returning at once: vLLM's loop would "
        "otherwise spin through empty steps, holding a core and the GIL the transfer threads need (0 turns "
        "it off)"),
    Key("offload_prompt_only", BOOL, False,
        "store only the blocks of prompt tokens (vLLM 0.32's key). kvoffload's default differs from vLLM's "
        "(true): the blocks an answer fills are stored too, so a conversation's next turn finds its whole "
        "history"),
    Key("blocks_per_chunk", POSITIVE_INT, None,
        _VLLM_KEY + "`block_size` in engine blocks (given with `block_size`, they must agree)"),
    Key("self_describing_kv_events", BOOL, None,
        _VLLM_KEY + "`kv_events` as a boolean, true for `self_describing` (given with `kv_events`, they "
        "must agree)"),
    Key("max_tracker_size", POSITIVE_INT, DEFAULT_MEMORY,
        _VLLM_KEY + "how many keys `store_threshold` remembers (the most recently counted; a forgotten key "
        "starts from zero)"),
    Key("sync_load_budget_bytes", NON_NEGATIVE_INT, DEFAULT_SYNC_LOAD_BUDGET_BYTES,
        "vLLM 0.34's key: a hit of at most this many bytes (one worker's; the step's hits share the budget) "
        "is loaded within the step that schedules its request, before its forward pass, instead of one "
        "scheduler round trip later; larger hits load asynchronously; 0 turns it off. Models with one "
        "KV-cache group only: vLLM cannot undo a failed load of a request already running on a model with "
        "several",
        shown_default="`16777216` (16 MiB)"),
    Key("control_port", PORT, None,
        "serve the session control endpoint (retain, release, prefetch, inspect: README's \"Sessions and "
        "controls\") on this port beside the engine (data-parallel engines: this port plus each engine's "
        "local rank); `0` takes a free port (logged)",
        shown_default="off"),
    Key("control_host", text("address", "be a non-empty address", bool), DEFAULT_CONTROL_HOST,
        "the address the control endpoint binds to; anything but loopback should set `control_token`"),
    Key("control_token", text("string", "be a non-empty string", bool), None,
        "a bearer token every control request must carry (`Authorization: Bearer ...`); it opens every "
        "tenant's sessions",
        shown_default="none"),
    Key("control_tenant_tokens", custom("mapping", _tenant_tokens), None,
        'tokens that each open one tenant\'s sessions only, `{"<cache_salt>": "<token>"}` (`""`: requests '
        "without a salt): with one, a tenant cannot hold, drop or inspect another's sessions (403). A token "
        "is required once any token is set; every token must differ",
        shown_default="none"),
    Key("control_timeout_s", seconds(0.01, 600), DEFAULT_CONTROL_TIMEOUT_S,
        "how long a control request waits for the engine's scheduler to take it before it is answered 503"),
    RETENTION_FRACTION,
    PREFETCH_IN_FLIGHT,
    PREFETCH_BATCH,
), where="kv_connector_extra_config[{key!r}]",
   unknown="unknown kv_connector_extra_config key(s) {unknown}; known: {known}")  # fmt: skip
KNOWN_KEYS = EXTRA_CONFIG.names

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
    control_port: int | None = None  # the session control endpoint: None = off
    control_host: str = DEFAULT_CONTROL_HOST
    control_token: str | None = None
    control_tenant_tokens: Mapping[str, str] | None = None  # tenant -> its own token
    control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S


def parse_extra_config(extra: Mapping[str, Any] | None, engine_block_size: int) -> OffloadConfig:
    """Validate ``extra`` against an engine whose device blocks hold ``engine_block_size`` tokens."""
    extra = dict(extra or {})
    for key in sorted(set(extra) & set(VLLM_ONLY_KEYS)):
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] is vLLM's OffloadingConnector's: {VLLM_ONLY_KEYS[key]}"
        )
    values = EXTRA_CONFIG.parse(extra)
    if values["blocks_per_chunk"] is not None:
        chunk = values["blocks_per_chunk"] * engine_block_size
        if values["block_size"] not in (None, chunk):
            raise ValueError(
                f"kv_connector_extra_config['blocks_per_chunk'] ({values['blocks_per_chunk']} engine blocks: "
                f"{chunk} tokens) disagrees with block_size={values['block_size']!r}"
            )
        values["block_size"] = chunk
    block_size = values["block_size"] or engine_block_size
    if block_size % engine_block_size:
        raise ValueError(
            f"kv_connector_extra_config['block_size'] must be a multiple of the engine block size "
            f"{engine_block_size}, got {block_size}"
        )
    flag = values["self_describing_kv_events"]
    if flag is not None:
        events = "self_describing" if flag else "placeholder"
        if "kv_events" in extra and values["kv_events"] != events:
            raise ValueError(
                f"kv_connector_extra_config['self_describing_kv_events']={flag!r} disagrees with "
                f"kv_events={values['kv_events']!r}"
            )
        values["kv_events"] = events
    tenant_tokens = values["control_tenant_tokens"]
    if tenant_tokens is not None:
        try:
            tenant_scopes(values["control_token"], tenant_tokens)
        except ValueError as exc:
            raise ValueError(f"kv_connector_extra_config['control_tenant_tokens']: {exc}") from None
    tiers = TierConfig(
        values["cpu_bytes_to_use"],
        block_size // engine_block_size,
        values["eviction_policy"],
        values["secondary_tiers"],
        values["retention_fraction"],
        values["prefetch_in_flight"],
        values["prefetch_batch"],
    )
    return OffloadConfig(
        tiers,
        values["kv_events"],
        values["store_threshold"],
        values["fault_injection"],
        values["switch_interval_s"],
        values["sync_stores"],
        values["idle_wait_s"],
        values["offload_prompt_only"],
        values["max_tracker_size"],
        values["sync_load_budget_bytes"],
        values["control_port"],
        values["control_host"],
        values["control_token"],
        tenant_tokens,
        values["control_timeout_s"],
    )
