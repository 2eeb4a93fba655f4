"""A shared tier's job checked at submission (the Redis and Mooncake workers).

``check_job(worker, directions, remote_type, job_id, src_spec, dst_spec, num_blocks)``
returns ``(direction, host_ids, keys)`` for a job between the host pool and a shared
store, or raises before anything moves: ``TypeError`` for a medium pair the worker does
not move (``directions`` maps ``(src medium, dst medium)`` to the worker's direction) or
a spec of another class, ``ValueError`` for as many host blocks as keys not matching or a
host block id outside ``[0, num_blocks)``, naming the bad value.
"""

from __future__ import annotations

from kvoffload.specs import MEDIUM_CPU, CPULoadStoreSpec, LoadStoreSpec


def check_job(
    worker: str,
    directions: dict[tuple[str, str], str],
    remote_type: type,
    job_id: int,
    src_spec: LoadStoreSpec,
    dst_spec: LoadStoreSpec,
    num_blocks: int,
) -> tuple[str, list[int], list[bytes]]:
    direction = directions.get((src_spec.medium, dst_spec.medium))
    if direction is None:
        raise TypeError(f"{worker} does not move {src_spec.medium} -> {dst_spec.medium} jobs")
    host, remote = (src_spec, dst_spec) if src_spec.medium == MEDIUM_CPU else (dst_spec, src_spec)
    if not isinstance(host, CPULoadStoreSpec) or not isinstance(remote, remote_type):
        raise TypeError(f"expected a CPU and a {remote_type.__name__}, got {src_spec!r}, {dst_spec!r}")
    host_ids = host.block_ids.tolist()
    if len(host_ids) != len(remote.keys):
        raise ValueError(f"{len(host_ids)} host blocks but {len(remote.keys)} keys in job {job_id}")
    bad = [b for b in host_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"host block id {bad[0]} out of range [0, {num_blocks})")
    return direction, host_ids, [bytes(key) for key in remote.keys]
