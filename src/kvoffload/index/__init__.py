"""A KV-block index for routers: engines' KV events in, per-engine per-tier prefix scores out.

Modules, one concept each (each docstring states its contract):

* ``tiers``: device / host / disk / shared, how wire events name them, tier weights.
* ``table``: one namespace's hash -> (engine, tier) holder bitmask, refcounted.
* ``groups``: which blocks a KV-cache group needs for a hit (hybrid models).
* ``tokens``: block hashes learned from the token ids events carry.
* ``space``: one (model, tenant): engines, tables per (LoRA, group), event application.
* ``scoring``: longest prefix per engine and tier, cumulative, and the weighted score.
* ``core``: ``BlockIndex``, the thread-safe facade: engines, ingestion, queries.
* ``state``: EXACT / DEGRADED / FALLBACK.
* ``source``: one publisher's stream into the index (a thread, a gap-repairing subscriber).
* ``service``: registrations in, running sources out.
* ``metrics``, ``server``: Prometheus metrics and the HTTP API (``kvoffload index serve``).

Importing the package loads nothing heavy; ``source`` and ``service`` load pyzmq, the
server aiohttp.
"""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "BlockIndex": "kvoffload.index.core",
    "EngineMatch": "kvoffload.index.core",
    "QueryResult": "kvoffload.index.core",
    "GroupSpec": "kvoffload.index.groups",
    "IndexMetrics": "kvoffload.index.metrics",
    "IndexServer": "kvoffload.index.server",
    "create_app": "kvoffload.index.server",
    "IndexService": "kvoffload.index.service",
    "Registration": "kvoffload.index.service",
    "RegistrationConflict": "kvoffload.index.service",
    "EventSource": "kvoffload.index.source",
    "SourceStats": "kvoffload.index.source",
    "Engine": "kvoffload.index.space",
    "IndexStats": "kvoffload.index.space",
    "SourceState": "kvoffload.index.state",
    "DEVICE": "kvoffload.index.tiers",
    "DISK": "kvoffload.index.tiers",
    "HOST": "kvoffload.index.tiers",
    "SHARED": "kvoffload.index.tiers",
    "TIER_NAMES": "kvoffload.index.tiers",
    "TierWeights": "kvoffload.index.tiers",
    "tier_of": "kvoffload.index.tiers",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
