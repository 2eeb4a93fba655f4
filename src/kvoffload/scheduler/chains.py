"""Loads chained on promotions: which keys of a load still wait for which promotion.

A load planned on blocks still being promoted into the CPU tier (``kvoffload.tiers.chained``)
pins its loadable keys at once; each other key is pinned when its promotion completes
successfully, in the same ``complete_jobs`` call (a promotion's outcome is applied before
the loads of that call). Completing or cancelling the load unpins only what was pinned: a
key whose promotion failed, or that is still waiting, was never pinned.

Plain bookkeeping for the ``OffloadingScheduler``: promotions are named by their
``TierTransfer`` token, loads by their job id.
"""

from __future__ import annotations

from kvoffload.keys import OffloadKey


class LoadChains:
    """The waiting keys of every chained load in flight."""

    def __init__(self) -> None:
        self._by_token: dict[int, dict[int, list[OffloadKey]]] = {}  # token -> load job -> keys
        self._unpinned: dict[int, dict[OffloadKey, int]] = {}  # load job -> key -> its token

    def __bool__(self) -> bool:
        return bool(self._unpinned)

    def add(self, job_id: int, waiting: dict[int, list[OffloadKey]]) -> None:
        """Load ``job_id`` waits for ``waiting`` (promotion token -> its keys)."""
        unpinned = self._unpinned.setdefault(job_id, {})
        for token, keys in waiting.items():
            self._by_token.setdefault(token, {})[job_id] = keys
            unpinned.update(dict.fromkeys(keys, token))

    def promoted(self, token: int, success: bool) -> dict[int, list[OffloadKey]]:
        """The promotion ``token`` completed: ``{load job: keys}`` to pin now (none if it
        failed: they stay unpinned)."""
        waiting = self._by_token.pop(token, {})
        if not success:
            return {}
        for job_id, keys in waiting.items():
            unpinned = self._unpinned[job_id]
            for key in keys:
                del unpinned[key]
        return waiting

    def pinned(self, job_id: int, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Load ``job_id`` (of ``keys``) ends: forget it; the keys to unpin, in order."""
        unpinned = self._unpinned.pop(job_id, None)
        if unpinned is None:
            return keys
        for token in set(unpinned.values()):
            loads = self._by_token.get(token)
            if loads is not None:
                loads.pop(job_id, None)
                if not loads:
                    del self._by_token[token]
        return [key for key in keys if key not in unpinned]

    def waits(self, job_id: int) -> bool:
        """Whether load ``job_id`` has keys whose promotion has not completed."""
        return bool(self._unpinned.get(job_id))

    def clear(self) -> None:
        self._by_token.clear()
        self._unpinned.clear()
