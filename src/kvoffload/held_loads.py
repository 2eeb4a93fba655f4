"""A load held for the promotions that fill its host blocks, started piece by piece.

``kvoffload.worker.WorkerRouter`` holds a job that reads host blocks a promotion still
writes. ``HeldLoad`` is its bookkeeping: which of its host blocks still wait for which
promotion (``waiting``), and which pieces of it can be started now (``ready_pieces``).

A load from host memory to the device (``CPULoadStoreSpec`` -> ``DeviceLoadStoreSpec``)
with one host block per device block (``group_sizes`` summing to the host block count)
is *divisible*: a run of consecutive positions within one KV-cache group is a load of its
own (the same group, ``block_indices`` moved to the run's first position), so the blocks
already in host memory, and those a promotion reports written before it ends, can be
copied while the rest is still read (the blocks there at submission at once, then runs
of at least a ``MAX_PIECES``-th of the load, one piece at a time, and the rest when the
promotion ended). Any other load is started whole once every block arrived. A piece is
never started before all of its host blocks arrived, nor after a promotion the load reads
from failed; the load's one result (``result_fields``) is posted once every piece started
has finished: failed if a promotion or a piece failed (the device blocks are then
unspecified), else successful with the bytes of all pieces.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE, CPULoadStoreSpec, DeviceLoadStoreSpec, LoadStoreSpec

# A piece started while the promotion runs has at least a MAX_PIECES-th of the load (but
# the blocks there at submission and the last ones): each is a job of the load's worker
# (planning, a hand-off to its thread), which on a busy host costs more than the overlap
# gains once pieces are small (bench_tier_ttft, 2 shared cores: a 62-block disk hit's
# load in 13 pieces put its KV in place at 32 ms where one job took 18-23 ms). A quarter
# matches the disk tier's native read runs (~4 MiB: a 62-block hit is 4 runs), so each
# run's copy can start while the next ones are read.
MAX_PIECES = 4


class HeldLoad:
    """One held job: ``worker`` runs it (or its pieces); ``waiting`` maps each host block not
    written yet to the promotion writing it; ``writers`` are those promotions."""

    def __init__(self, worker, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec, waiting: dict[int, int]):
        self.worker = worker
        self.src_spec, self.dst_spec = src_spec, dst_spec
        self.waiting = waiting
        self.writers = set(waiting.values())
        self.error: str | None = None  # a writer or a piece failed: nothing more starts
        self.pieces: set[int] = set()  # piece ids in flight
        self.started = 0  # positions handed out in pieces
        self.moved = 0
        self.seconds = 0.0
        self.direction = f"{src_spec.medium}->{dst_spec.medium}"
        self._host = np.asarray(src_spec.block_ids, dtype=np.int64)
        self._pending = np.ones(len(self._host), dtype=bool)  # not handed out yet
        self._groups = self._group_of_positions()
        self.min_piece = -(-len(self._host) // MAX_PIECES)
        self._asked = False  # ready_pieces was called (at submission)
        self.submitted = False  # set once its submit applied the news of its promotions

    def _group_of_positions(self) -> np.ndarray | None:
        """Each position's KV-cache group where the load is divisible, else ``None``."""
        src, dst = self.src_spec, self.dst_spec
        if not (src.medium == MEDIUM_CPU and dst.medium == MEDIUM_DEVICE):
            return None
        if not (isinstance(src, CPULoadStoreSpec) and isinstance(dst, DeviceLoadStoreSpec)):
            return None
        if len(dst.block_ids) != len(self._host):
            return None
        return np.repeat(np.arange(dst.num_groups), dst.group_sizes)

    @property
    def divisible(self) -> bool:
        return self._groups is not None

    def written(self, writer: int, blocks) -> None:
        """``writer`` reports ``blocks`` (host block ids) fully written and checked."""
        waiting = self.waiting
        for block in blocks:
            if waiting.get(block) == writer:
                del waiting[block]

    def writer_done(self, writer: int, success: bool, error: str | None) -> None:
        """Promotion ``writer`` finished: its blocks arrived, or the load fails."""
        self.writers.discard(writer)
        if success:
            for block in [b for b, w in self.waiting.items() if w == writer]:
                del self.waiting[block]
        elif self.error is None:
            self.error = f"promotion {writer} of its source blocks failed: {error}"

    def whole_ready(self) -> bool:
        """Nothing started yet and every block arrived: start the job whole, as it is."""
        return self.error is None and not self.started and not self.waiting

    def ready_pieces(self) -> Iterator[tuple[CPULoadStoreSpec, DeviceLoadStoreSpec]]:
        """The pieces that can start now (each run of consecutive positions in one group
        whose host blocks all arrived, of at least ``min_piece`` positions unless they are
        the last ones), marked started. While a piece of it runs, only the last ones: the
        blocks that arrive meanwhile start together once it finished, so a busy host copies
        in fewer, larger pieces. Nothing once a promotion failed."""
        if self.error is not None or self._groups is None:
            return
        at_submission, self._asked = not self._asked, True
        waiting = self.waiting
        ready = self._pending.copy()
        if waiting:
            ready &= ~np.fromiter((int(b) in waiting for b in self._host), bool, len(self._host))
        if not ready.any():
            return
        dst: DeviceLoadStoreSpec = self.dst_spec  # type: ignore[assignment]
        starts = np.concatenate(([0], np.cumsum(dst.group_sizes)))
        groups = self._groups
        positions = np.flatnonzero(ready)
        # cut where positions stop being consecutive or the group changes
        cuts = np.flatnonzero((np.diff(positions) != 1) | (np.diff(groups[positions]) != 0)) + 1
        # the blocks there at submission, and the last ones, go whatever their count
        final = len(positions) == int(self._pending.sum())
        if self.pieces and not final:
            return  # one piece at a time: what arrives while it copies goes next, as one
        any_size = at_submission or final
        for run in np.split(positions, cuts):
            if len(run) < self.min_piece and not any_size:
                continue  # a piece costs a job of its own: wait until it grew
            first, last = int(run[0]), int(run[-1]) + 1
            group = int(groups[first])
            sizes = np.zeros(dst.num_groups, dtype=np.int64)
            sizes[group] = last - first
            indices = dst.block_indices.copy()
            indices[group] += first - starts[group]
            self._pending[first:last] = False
            self.started += last - first
            yield (
                CPULoadStoreSpec(self._host[first:last]),
                DeviceLoadStoreSpec(dst.block_ids[first:last], sizes, indices),
            )

    def piece_done(self, result) -> None:
        """A piece's ``TransferResult``."""
        self.pieces.discard(result.job_id)
        self.direction = result.direction or self.direction
        if result.success:
            self.moved += result.bytes
            self.seconds += result.seconds
        elif self.error is None:
            self.error = f"a part of it failed: {result.error}"

    def fail(self, error: str) -> None:
        if self.error is None:
            self.error = error

    def finished(self) -> bool:
        """All of it ran (or, after a failure, nothing of it still runs)."""
        if self.pieces:
            return False
        return self.error is not None or (self.started == len(self._host) and not self.waiting)

    def result_fields(self) -> tuple[bool, int, float, str, str | None]:
        ok = self.error is None
        return ok, self.moved if ok else 0, self.seconds if ok else 0.0, self.direction, self.error
