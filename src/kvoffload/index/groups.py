"""KV-cache groups as the index sees them: which of a prompt's blocks a group needs.

Contract:

* A ``GroupSpec(kind, sliding_window)`` comes from the ``kv_cache_spec_kind`` and
  ``kv_cache_spec_sliding_window`` fields of ``BlockStored`` events (vLLM 0.32 names).
* ``window_blocks(block_size)`` says how many blocks before a prefix's end the group needs
  for a hit of that prefix: ``None`` for every block (full attention, MLA, and any kind
  the index does not know, the safe choice), ``ceil((window - 1) / block_size)`` (at
  least 1) for sliding-window and chunked-local attention (as vLLM's prefix cache counts
  it), 1 for Mamba (the state after the last block). A sliding kind without a window
  counts as full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla", "chunked_local_attention"})
LAST_BLOCK_KINDS = frozenset({"mamba"})
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class GroupSpec:
    kind: str = FULL_ATTENTION
    sliding_window: int | None = None

    def window_blocks(self, block_size: int) -> int | None:
        """Blocks needed before a prefix's end; ``None`` when the group needs all of them."""
        if self.kind in LAST_BLOCK_KINDS:
            return 1
        if self.kind in SLIDING_KINDS and self.sliding_window and self.sliding_window > 0:
            return max(1, -(-(self.sliding_window - 1) // block_size))
        return None

    def as_dict(self) -> dict:
        return {"kind": self.kind, "sliding_window": self.sliding_window}


DEFAULT_GROUP = GroupSpec()
