"""How far a source's entries can be trusted: the states of vLLM's router RFC #294.

* ``EXACT``: every batch the publisher sent in its current lifetime (or since its last
  ``AllBlocksCleared``) has been applied, in order: the entries are the engine's state.
* ``DEGRADED``: some batch was lost (a gap the replay could not fill, a payload that did
  not decode, a late join without the publisher's beginning): the entries are a best
  effort and are reported, but never claimed exact. An ``AllBlocksCleared`` or a
  publisher restart replayed from its first batch makes the source ``EXACT`` again.
* ``FALLBACK``: the index knows nothing it can vouch for yet (no batch and no replay
  answer since registration, or the ingestion stopped): routers should fall back to
  their own heuristics for this engine.
"""

from __future__ import annotations

from enum import StrEnum


class SourceState(StrEnum):
    EXACT = "EXACT"
    DEGRADED = "DEGRADED"
    FALLBACK = "FALLBACK"
