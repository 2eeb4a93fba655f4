"""The local-disk tier (``"fs"``): blocks in slot files under ``<root_dir>/<namespace>``.

* ``FSOffloadingManager`` (``manager``): scheduler-side bookkeeping, index in memory.
* ``FSWorker`` (``worker``): host pool <-> disk jobs on a bounded thread pool.
* ``fs_namespace``, ``namespace_identity``, ``layout_identity`` (``namespace``): the
  directory that keeps engines with other byte layouts apart.
* ``format``: files, slot geometry and header records; ``block_io``: the crash-safe
  write/read protocol (its runs read and checked without the GIL by the ``_runread``
  extension); ``scan``: the index rebuild; ``index``/``order``: compact index
  and eviction order; ``space``: reserved file space; ``floor``: the free-space floor;
  ``direct``: ``O_DIRECT`` reads; ``tier``: the ``"fs"`` entry of ``secondary_tiers``.

Names are re-exported lazily: importing the manager never loads torch.
"""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "FSOffloadingManager": "kvoffload.tiers.fs.manager",
    "FSManagerCounters": "kvoffload.tiers.fs.manager",
    "FSWorker": "kvoffload.tiers.fs.worker",
    "FSWorkerCounters": "kvoffload.tiers.fs.worker",
    "Geometry": "kvoffload.tiers.fs.format",
    "fs_namespace": "kvoffload.tiers.fs.namespace",
    "namespace_identity": "kvoffload.tiers.fs.namespace",
    "layout_identity": "kvoffload.tiers.fs.namespace",
    "describe": "kvoffload.tiers.fs.namespace",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
