"""Capacity planning with a disk tier: what do a CPU tier and a disk tier below it buy?

``plan_disk`` replays one trace for every (policy, CPU capacity, disk capacity) triple with
the protocol of ``kvoffload.sim.disk`` and turns block counts into tokens, bytes and time
with ``kvoffload.sim.planning.CostModel``: a hit token skips prefill; a CPU or disk hit
crosses the host-to-device link; a disk hit (every block promoted, in fact) is read from
disk first at ``disk_bandwidth_bytes_per_s``. Stores and writes to disk are not charged.

Capacities are text, as in ``kvoffload.sim.planning.parse_capacity`` (``"5%"``, ``"0.05"``,
``"2000"`` blocks, ``"64GiB"``); a fraction is of the trace's unique blocks. The disk
tier's eviction policy is the row's policy unless ``disk_policy`` names one. Admission to
the disk tier (``ADMISSION``): ``"all"`` writes every block stored to the CPU tier through
to disk; ``"seen-twice"`` (Dynamo KVBM's rule, ``kvoffload.tiers.admission.SeenTwice``)
only blocks offered a second time, remembering as many keys as the disk tier has blocks.
The default is ``"all"``, from ``bench/bench_disk_sim.py``: on the Mooncake conversation
trace (CPU 5%, disk 25% of the unique blocks) it serves 0.353 of the block references
against 0.262 for ``"seen-twice"``, for 6.9x the bytes written to disk; seen-twice wins only
with a disk of 10% on the one-shot ``documents`` and ``chat`` workloads.
Belady's offline optimum has no two-tier replay here and is refused.

An object-storage tier below the disk (``object_capacity``, ``kvoffload.sim.object_tier``):
its hits are read at ``object_bandwidth_bytes_per_s`` after ``object_latency_s`` once per
request that has any (its GETs run at once); ``object_writes`` says whether it takes every
block written through (``"through"``, kvoffload's way) or only what the disk evicts
(``"on-eviction"``, each such block read back from disk first: ``disk_bytes_read``
counts it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.sim.disk import build_tiers, replay_disk
from kvoffload.sim.object_tier import DEFAULT_OBJECT_WRITES, OBJECT_WRITES, build_object_tiers
from kvoffload.sim.planning import BELADY, CostModel, parse_capacity, validate_policies
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.tiered import device_prefixes
from kvoffload.sim.trace import Trace
from kvoffload.tiers.admission import SeenTwice
from kvoffload.tiers.tiered import Admit

ADMISSION = ("all", "seen-twice")
DEFAULT_ADMISSION = "all"
_DEFAULT_COST = CostModel()


def admission_rule(name: str, disk_blocks: int) -> Admit | None:
    """The admit callable (``None`` = every block) of an ``ADMISSION`` name."""
    if name == "all":
        return None
    if name == "seen-twice":
        return SeenTwice(max(1, disk_blocks))
    raise ValueError(f"unknown disk admission rule {name!r}; known: {', '.join(ADMISSION)}")


@dataclass(frozen=True)
class DiskPlanRow:
    """One (policy, CPU capacity, disk capacity) result; ratios are of all block references."""

    policy: str
    capacity: str
    blocks: int
    fraction: float  # of the trace's unique blocks
    disk_capacity: str
    disk_blocks: int
    disk_fraction: float
    admit: str
    requests: int
    device_hit_ratio: float
    cpu_hit_ratio: float
    disk_hit_ratio: float
    hit_ratio: float
    device_tokens_saved: int
    cpu_tokens_saved: int
    disk_tokens_saved: int
    bytes_loaded: int  # CPU -> device
    cpu_bytes_read: int
    cpu_bytes_written: int
    disk_bytes_read: int
    disk_bytes_written: int
    disk_blocks_not_promoted: int  # found on disk, but more than the CPU tier could take
    prefill_s_saved: float
    replay_s: float
    object_capacity: str = ""  # no object tier
    object_blocks: int = 0
    object_writes: str = ""
    object_hit_ratio: float = 0.0
    object_tokens_saved: int = 0
    object_bytes_read: int = 0
    object_bytes_written: int = 0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.replay_s if self.replay_s > 0 else float("inf")


def plan_disk(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[str],
    disk_capacities: Sequence[str],
    device_blocks: int = 0,
    cost: CostModel = _DEFAULT_COST,
    admit: str = DEFAULT_ADMISSION,
    disk_policy: str | None = None,
    progress: Callable[[str], None] | None = None,
    object_capacity: str | None = None,
    object_writes: str = DEFAULT_OBJECT_WRITES,
) -> list[DiskPlanRow]:
    """Rows in (policy, CPU capacity, disk capacity) order."""
    if object_writes not in OBJECT_WRITES:
        raise ValueError(f"unknown object writes {object_writes!r}; known: {', '.join(OBJECT_WRITES)}")
    policies = validate_policies(policies)
    for name in policies:
        if name.lower() == BELADY:
            raise ValueError(f"policy {name!r} has no replay with a disk tier; give online policies")
    if disk_policy is not None:
        validate_policies([disk_policy])
    admission_rule(admit, 1)  # an unknown name fails before any replay
    unique = trace.unique_blocks()
    block_bytes = trace.block_size * cost.kv_bytes_per_token
    sizes = [(spec, parse_capacity(spec, unique, block_bytes)) for spec in capacities]
    disk_sizes = [(spec, parse_capacity(spec, unique, block_bytes)) for spec in disk_capacities]
    object_blocks = 0 if object_capacity is None else parse_capacity(object_capacity, unique, block_bytes)
    key_lists = to_key_lists(trace.requests)
    lengths = [r.input_length for r in trace.requests]
    served = device_prefixes(key_lists, device_blocks)
    rows = []
    for name in policies:
        for spec, blocks in sizes:
            for disk_spec, disk_blocks in disk_sizes:
                if progress:
                    progress(f"{name} @ {spec} + disk {disk_spec}")
                rule = admission_rule(admit, disk_blocks)
                if object_blocks:
                    tiers = build_object_tiers(
                        blocks, disk_blocks, object_blocks, name, disk_policy, rule, object_writes
                    )
                else:
                    tiers = build_tiers(blocks, disk_blocks, name, disk_policy, rule)
                r = replay_disk(tiers, key_lists, served, lengths, trace.block_size)
                saved = (
                    (r.device_tokens + r.cpu_tokens + r.disk_tokens + r.object_tokens)
                    / cost.prefill_tokens_per_s
                    - r.loaded * block_bytes / cost.bandwidth_bytes_per_s
                    - r.promoted * block_bytes / cost.disk_bandwidth_bytes_per_s
                    - r.object_promoted * block_bytes / cost.object_bandwidth_bytes_per_s
                    - r.object_requests * cost.object_latency_s
                )
                rows.append(
                    DiskPlanRow(
                        policy=name,
                        capacity=spec,
                        blocks=blocks,
                        fraction=blocks / unique if unique else 0.0,
                        disk_capacity=disk_spec,
                        disk_blocks=disk_blocks,
                        disk_fraction=disk_blocks / unique if unique else 0.0,
                        admit=admit,
                        requests=r.requests,
                        device_hit_ratio=r.device_hit_ratio,
                        cpu_hit_ratio=r.cpu_hit_ratio,
                        disk_hit_ratio=r.disk_hit_ratio,
                        hit_ratio=r.hit_ratio,
                        device_tokens_saved=r.device_tokens,
                        cpu_tokens_saved=r.cpu_tokens,
                        disk_tokens_saved=r.disk_tokens,
                        bytes_loaded=r.loaded * block_bytes,
                        cpu_bytes_read=r.cpu_blocks_read * block_bytes,
                        cpu_bytes_written=r.cpu_blocks_written * block_bytes,
                        disk_bytes_read=(r.promoted + r.eviction_reads) * block_bytes,
                        disk_bytes_written=r.written * block_bytes,
                        disk_blocks_not_promoted=r.not_promoted,
                        prefill_s_saved=saved,
                        replay_s=r.seconds,
                        object_capacity=object_capacity or "",
                        object_blocks=object_blocks,
                        object_writes=object_writes if object_blocks else "",
                        object_hit_ratio=r.object_hit_ratio,
                        object_tokens_saved=r.object_tokens,
                        object_bytes_read=r.object_promoted * block_bytes,
                        object_bytes_written=r.object_written * block_bytes,
                    )
                )
    return rows
