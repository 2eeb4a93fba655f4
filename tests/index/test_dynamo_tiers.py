"""kvoffload's lower-tier KV events against Dynamo's standalone KV indexer
(``ai-dynamo-runtime==1.6.1``, run from its own environment: ``tests/dynamo_env.py``).

The events are those kvoffload's scheduler publishes, made by its own converter
(``kvoffload.scheduler.events.EventConverter``) from tier events of the CPU tier
(``"CPU"``), the local-disk tier (``"DISK"``) and the shared Redis tier (``"REMOTE"``), and
published by kvoffload's ZMQ publisher to Dynamo's indexer and to ours.

What Dynamo 1.6.1 does with them (measured here, pinned by the tests):

* It maps ``medium`` to its tiers: ``GPU`` -> device, ``CPU`` -> host_pinned, ``STORAGE``
  -> disk, ``EXTERNAL`` -> external (its ``/dump`` names them so); ``locality="LOCAL"``
  changes nothing. ``/query`` reports ``gpu``, ``cpu`` and ``disk`` matched tokens per
  instance (cumulative, like ours); the external tier has no field of its own there and
  counts in ``disk``.
* It drops, silently (no log line even at ``DYN_LOG=trace``, no counter in ``/metrics``),
  every event that carries an ``ownership`` (any string, even ``""``; vLLM's msgspec
  encoding leaves the field out when it is ``None``), whatever its medium, and every
  event with ``locality="REMOTE"``, whatever its ownership. The stream is not broken:
  later events on it are indexed, the listener stays ``active``.
* kvoffload announces the disk tier as ``STORAGE``/``LOCAL`` with no ownership, as vLLM
  0.32's own ``fs`` tier does: Dynamo indexes them as its disk tier and agrees with our
  index block for block (with ``ownership="fs"``, which kvoffload sent before, Dynamo
  dropped them all). The shared tier is ``STORAGE``/``REMOTE``/``ownership="redis"``:
  Dynamo accepts it on the stream but indexes it neither with its ownership nor without
  (it has no index for shared, ``REMOTE``, blocks yet); ours counts it as ``shared``.

* Its ``/query_by_hash`` takes other hashes than ours under the same field name
  (``block_hashes``): its own hash of each block's tokens, not the engine's block hashes.
* Its ``/query`` answer has the same ``scores`` and ``longest_matched`` as ours, but the
  per-tier breakdown sits elsewhere (``instances[id]`` has ``gpu``/``cpu``/``disk`` and
  ``dp: {rank: device tokens}``; ours has ``dp: {rank: {gpu, cpu, disk, shared, ...}}``),
  and no ``tree_sizes``.

"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from dynamo_env import (
    DynamoIndexer,
    dynamo_block_hashes,
    dynamo_python_or_skip,
    http_call,
)
from kvoffload.events import BlockStored, ZmqEventPublisher
from kvoffload.index import BlockIndex, IndexServer, IndexService, TierWeights
from kvoffload.keys import BlockHasher, make_offload_key
from kvoffload.manager import OffloadingEvent
from kvoffload.scheduler.events import EventConverter
from kvoffload.scheduler.types import KVGroup

pytestmark = pytest.mark.timeout(300)

MODEL = "m"
BS = 16
TOKENS = list(range(1000, 1000 + 12 * BS))


@pytest.fixture(scope="module")
def dynamo_bin() -> Path:
    return dynamo_python_or_skip()


@pytest.fixture
def both(dynamo_bin, tmp_path) -> Iterator[tuple[DynamoIndexer, IndexServer]]:
    service = IndexService(BlockIndex(TierWeights()))
    with (
        DynamoIndexer(dynamo_bin, tmp_path / "indexer.log") as dyn,
        IndexServer(service, "127.0.0.1", 0) as ours,
    ):
        yield dyn, ours


class Engine:
    """One publisher, registered with both indexes as one instance; ``events(medium,
    n)`` are what kvoffload's converter makes of a tier announcing the first ``n`` blocks
    of ``TOKENS``."""

    def __init__(self, dyn: DynamoIndexer, ours: IndexServer, instance: int, tmp_path: Path) -> None:
        self.instance = instance
        self.pub = ZmqEventPublisher(f"ipc://{tmp_path}/pub{instance}", f"ipc://{tmp_path}/replay{instance}")
        body = {
            "instance_id": instance,
            "endpoint": self.pub.endpoint,
            "replay_endpoint": self.pub.replay_endpoint,
            "model_name": MODEL,
            "block_size": BS,
        }
        assert dyn.call("/register", body)[0] == 201
        assert call(ours, "/register", body)[0] == 201
        self.hashes = BlockHasher().hash_request(TOKENS, BS)
        self.keys = [make_offload_key(h, 0) for h in self.hashes]
        self.converter = EventConverter([KVGroup(BS)], 1)
        for i, key in enumerate(self.keys):
            self.converter.remember(key, self.hashes[i - 1] if i else None, TOKENS, i * BS, (i + 1) * BS)

        self.markers = 0

    # Dynamo applies each tier's events on a queue of its own: a marker in one tier says
    # nothing of the others. A marker is one block of fresh tokens in each tier that can
    # hold it (device, host, disk in the form Dynamo indexes), in one batch.
    MARKER_FORMS = (("gpu", "GPU", None), ("cpu", "CPU", None), ("disk", "STORAGE", "LOCAL"))

    def publish_marker(self) -> list[tuple[str, list[int]]]:
        from kvoffload.keys import external_hash

        batch, marker = [], []
        for t, (tier, medium, locality) in enumerate(self.MARKER_FORMS):
            tokens = [100_000 + 1000 * self.instance + 10 * self.markers + t] * BS
            block_hash = external_hash(BlockHasher().hash_request(tokens, BS)[0])
            batch.append(BlockStored([block_hash], None, tokens, BS, None, medium, None, locality=locality))
            marker.append((tier, tokens))
        self.markers += 1
        self.pub.publish(batch)
        return marker

    def marker_seen(self, dyn: DynamoIndexer, ours: IndexServer, marker: list[tuple[str, list[int]]]) -> bool:
        for tier, tokens in marker:
            theirs, mine = tiers(dyn, ours, self.instance, tokens)
            if not theirs[tier] == mine[tier] == BS:
                return False
        return True

    def connect(self, dyn: DynamoIndexer, ours: IndexServer) -> None:
        """Publish a marker until both indexes show it: both subscribers are connected, so
        nothing published after is lost to a subscriber still joining."""
        deadline = time.monotonic() + 30
        while True:
            marker = self.publish_marker()
            stop = time.monotonic() + 0.5
            while time.monotonic() < stop:
                if self.marker_seen(dyn, ours, marker):
                    return
                time.sleep(0.05)
            assert time.monotonic() < deadline, f"instance {self.instance}: no index heard the publisher"

    def settle(self, dyn: DynamoIndexer, ours: IndexServer) -> None:
        """Publish a marker and wait until both indexes show it in every tier: everything
        published before it on this stream has been applied (each index applies a stream,
        and Dynamo each tier's share of it, in order)."""
        marker = self.publish_marker()
        wait_for(lambda: self.marker_seen(dyn, ours, marker), f"instance {self.instance}'s marker")

    def events(self, medium: str, n: int) -> list:
        return self.events_for(self.keys[:n], medium)

    def events_for(self, keys: list, medium: str, removed: bool = False) -> list:
        return self.converter.convert([OffloadingEvent(keys, medium, removed)])

    def device(self, n: int) -> list:
        """What the engine itself announces for its first ``n`` device blocks."""
        from kvoffload.keys import external_hash

        return [
            BlockStored(
                [external_hash(h) for h in self.hashes[:n]], None, TOKENS[: n * BS], BS, None, "GPU", None
            )
        ]

    def close(self) -> None:
        self.pub.close()


def call(server: IndexServer, path: str, body: object = None) -> tuple[int, object]:
    return http_call(server.url, path, body)


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def tiers(dyn: DynamoIndexer, ours: IndexServer, instance: int, tokens=TOKENS) -> tuple[dict, dict]:
    """Matched tokens per tier of ``instance``: Dynamo's (gpu, cpu, disk), ours (gpu, cpu,
    disk, shared)."""
    body = {"token_ids": tokens, "model_name": MODEL}
    status, theirs = dyn.call("/query", body)
    assert status == 200, theirs
    status, mine = call(ours, "/query", body)
    assert status == 200, mine
    t = theirs.get("instances", {}).get(str(instance)) or {}
    m = mine["instances"][str(instance)]["dp"]["0"]
    theirs_tiers = {k: t.get(k, 0) for k in ("gpu", "cpu", "disk")}
    return theirs_tiers, {k: m[k] for k in ("gpu", "cpu", "disk", "shared")}


def publish_and_settle(dyn, ours, engine: Engine, batches: list[list]) -> None:
    for batch in batches:
        engine.pub.publish(batch)
    engine.settle(dyn, ours)


def dynamo_tiers_held(dyn: DynamoIndexer, instance: int) -> set[str]:
    """The tiers Dynamo's ``/dump`` files blocks of ``TOKENS`` under for ``instance``."""
    from kvoffload.keys import external_hash

    ours = {external_hash(h) for h in BlockHasher().hash_request(TOKENS, BS)}
    status, dump = dyn.call("/dump")
    assert status == 200
    held = set()
    for space in dump.values():
        for entry in space.get("events", []):
            data = entry["event"]["data"]
            stored = data.get("stored") if isinstance(data, dict) else None
            if (
                entry["worker_id"] == instance
                and stored
                and any(b["block_hash"] in ours for b in stored["blocks"])
            ):
                held.add(entry["storage_tier"])
    return held


def listener_states(dyn: DynamoIndexer) -> dict[int, str]:
    status, workers = dyn.call("/workers")
    assert status == 200
    return {w["instance_id"]: w["status"] for w in workers}


WIRE_FORMS = [
    # (medium, locality, ownership), Dynamo's tier or None (dropped), ours
    (("GPU", None, None), "device", "gpu"),
    (("CPU", None, None), "host_pinned", "cpu"),  # kvoffload's CPU tier
    (("CPU", "LOCAL", None), "host_pinned", "cpu"),
    (("STORAGE", "LOCAL", None), "disk", "disk"),  # vLLM 0.32's own fs tier
    (("STORAGE", "LOCAL", "fs"), None, "disk"),  # kvoffload's disk tier
    (("STORAGE", "REMOTE", None), None, "shared"),
    (("STORAGE", "REMOTE", "redis"), None, "shared"),  # kvoffload's shared tier
    (("CPU", None, "kvoffload"), None, "cpu"),
    (("GPU", None, "x"), None, "gpu"),
    (("GPU", None, ""), None, "gpu"),
    (("EXTERNAL", None, None), "external", None),
]


def test_how_dynamo_maps_each_wire_form_to_a_tier(both, tmp_path) -> None:
    """One instance per wire form, each announcing the first 3 blocks of ``TOKENS`` in
    that form, then a marker on the same stream (so the form was delivered and applied
    before the marker shows): which tier Dynamo files the blocks under (its ``/dump``), or
    that it drops them; and which tier ours counts them in."""
    dyn, ours = both
    engines = [Engine(dyn, ours, i + 1, tmp_path) for i in range(len(WIRE_FORMS))]
    try:
        for engine, ((medium, locality, ownership), _, _) in zip(engines, WIRE_FORMS):
            engine.connect(dyn, ours)
            (stored,) = engine.device(3)
            engine.pub.publish(
                [msgspec.structs.replace(stored, medium=medium, locality=locality, ownership=ownership)]
            )
            engine.settle(dyn, ours)
        for engine, (form, dynamo_tier, our_tier) in zip(engines, WIRE_FORMS):
            held = dynamo_tiers_held(dyn, engine.instance)
            assert held == ({dynamo_tier} if dynamo_tier else set()), (form, held)
            theirs, mine = tiers(dyn, ours, engine.instance)
            if our_tier is not None:
                assert mine[our_tier] == 3 * BS, (form, mine)
            if dynamo_tier == "external":  # no field of its own in /query: it counts as disk
                assert theirs == {"gpu": 0, "cpu": 0, "disk": 3 * BS}, theirs
        assert set(listener_states(dyn).values()) == {"active"}
    finally:
        for engine in engines:
            engine.close()


def test_disk_tier_events_of_kvoffload_are_indexed_by_dynamo_as_disk(both, tmp_path) -> None:
    """kvoffload's disk-tier events (``STORAGE``/``LOCAL``, no ownership), made by its
    converter: Dynamo indexes them as its disk tier, and both indexes agree, also after
    the disk tier evicts a block (``BlockRemoved``, same form). 2 blocks on the device, 5
    in the CPU tier, 12 on disk."""
    dyn, ours = both
    engine = Engine(dyn, ours, 1, tmp_path)
    try:
        engine.connect(dyn, ours)
        disk = engine.events("DISK", 12)
        assert {(e.medium, e.locality, e.ownership) for e in disk} == {("STORAGE", "LOCAL", None)}
        assert all(e.token_ids and e.block_size == BS for e in disk)  # self-describing
        batches = [engine.device(2), engine.events("CPU", 5), disk]
        publish_and_settle(dyn, ours, engine, batches)
        theirs, mine = tiers(dyn, ours, 1)
        assert theirs == {"gpu": 2 * BS, "cpu": 5 * BS, "disk": 12 * BS}
        assert mine == {"gpu": 2 * BS, "cpu": 5 * BS, "disk": 12 * BS, "shared": 12 * BS}
        assert dynamo_tiers_held(dyn, 1) == {"device", "host_pinned", "disk"}
        assert listener_states(dyn) == {1: "active"}
        # the disk tier drops block 8: the disk-tier prefix ends there
        removed = engine.events_for([engine.keys[8]], "DISK", removed=True)
        assert {(e.medium, e.locality, e.ownership) for e in removed} == {("STORAGE", "LOCAL", None)}
        publish_and_settle(dyn, ours, engine, [removed])
        theirs, mine = tiers(dyn, ours, 1)
        assert theirs == {"gpu": 2 * BS, "cpu": 5 * BS, "disk": 8 * BS}
        assert mine == {"gpu": 2 * BS, "cpu": 5 * BS, "disk": 8 * BS, "shared": 8 * BS}
    finally:
        engine.close()


def test_shared_tier_events_of_kvoffload_are_dropped_by_dynamo(both, tmp_path) -> None:
    """kvoffload's shared-tier events (``STORAGE``/``REMOTE``/``redis``): accepted on the
    stream, indexed neither with their ownership nor without it: Dynamo drops ``REMOTE``
    events whatever their ownership (it has no shared index). Ours counts them as the
    shared tier."""
    dyn, ours = both
    engine = Engine(dyn, ours, 1, tmp_path)
    try:
        engine.connect(dyn, ours)
        shared = engine.events("REMOTE", 12)
        assert {(e.medium, e.locality, e.ownership) for e in shared} == {("STORAGE", "REMOTE", "redis")}
        bare = [msgspec.structs.replace(e, ownership=None) for e in shared]
        publish_and_settle(dyn, ours, engine, [engine.device(2), engine.events("CPU", 5), shared, bare])
        theirs, mine = tiers(dyn, ours, 1)
        assert mine == {"gpu": 2 * BS, "cpu": 5 * BS, "disk": 5 * BS, "shared": 12 * BS}
        assert theirs == {"gpu": 2 * BS, "cpu": 5 * BS, "disk": 5 * BS}
        assert dynamo_tiers_held(dyn, 1) == {"device", "host_pinned"}
        assert listener_states(dyn) == {1: "active"}
    finally:
        engine.close()


def test_query_by_hash_takes_other_hashes_in_dynamo(dynamo_bin, both, tmp_path) -> None:
    """The two ``/query_by_hash`` take different hashes under the same field name.
    Dynamo's ``block_hashes`` are its own hash of each block's tokens (its
    ``compute_block_hash_for_seq``: per block, not chained, the value its ``/query``
    computes from ``token_ids``); ours are the engine's chained block hashes, as the events
    carry them. Sent the engine's hashes, Dynamo matches nothing; sent its own, it
    matches; ours matches the engine's. ``/query`` with token ids agrees."""
    dyn, ours = both
    engine = Engine(dyn, ours, 1, tmp_path)
    try:
        engine.connect(dyn, ours)
        publish_and_settle(dyn, ours, engine, [engine.device(4)])
        from kvoffload.keys import external_hash

        def signed(values: list[int]) -> list[int]:  # Dynamo's field is i64
            return [v - (1 << 64) if v >= 1 << 63 else v for v in values]

        engine_hashes = signed([external_hash(h) for h in engine.hashes])
        dynamo_hashes = signed(dynamo_block_hashes(dynamo_bin, TOKENS, BS))
        assert len(dynamo_hashes) == len(engine_hashes) == 12
        assert not set(dynamo_hashes) & set(engine_hashes)

        def device_tokens(server_call, hashes: list[int]) -> int:
            status, answer = server_call("/query_by_hash", {"block_hashes": hashes, "model_name": MODEL})
            assert status == 200, answer
            return answer["scores"].get("1", {}).get("0", 0)

        assert device_tokens(dyn.call, engine_hashes) == 0
        assert device_tokens(dyn.call, dynamo_hashes) == 4 * BS
        assert device_tokens(lambda path, body: call(ours, path, body), engine_hashes) == 4 * BS
        theirs, mine = tiers(dyn, ours, 1)
        assert theirs["gpu"] == mine["gpu"] == 4 * BS
    finally:
        engine.close()


def test_query_response_shapes(both, tmp_path) -> None:
    """The ``/query`` answers of both for one engine holding 2 device, 5 host and 12 disk
    blocks (disk in the form Dynamo indexes). Same ``scores`` and ``longest_matched``;
    the per-tier breakdown sits elsewhere: Dynamo puts ``gpu``/``cpu``/``disk`` on the
    instance and ``dp`` maps each rank to its device tokens, ours puts the tiers (with
    ``shared``, ``weighted``, ``state``) under ``dp`` per rank, so ``dp`` holds numbers in
    one and objects in the other. Dynamo 1.6.1 sends no ``tree_sizes`` (ours keeps the
    field of its older answers) and an empty ``frequencies``."""
    dyn, ours = both
    engine = Engine(dyn, ours, 1, tmp_path)
    try:
        engine.connect(dyn, ours)
        disk = [msgspec.structs.replace(e, ownership=None) for e in engine.events("DISK", 12)]
        publish_and_settle(dyn, ours, engine, [engine.device(2), engine.events("CPU", 5), disk])
        body = {"token_ids": TOKENS, "model_name": MODEL}
        (_, theirs), (_, mine) = dyn.call("/query", body), call(ours, "/query", body)
        assert theirs["scores"] == mine["scores"] == {"1": {"0": 2 * BS}}
        assert set(theirs) == {"scores", "frequencies", "instances"} and theirs["frequencies"] == []
        assert {"scores", "frequencies", "tree_sizes", "instances"} <= set(mine)
        assert theirs["instances"] == {
            "1": {
                "longest_matched": 12 * BS,
                "gpu": 2 * BS,
                "cpu": 5 * BS,
                "disk": 12 * BS,
                "dp": {"0": 2 * BS},
            }
        }
        entry = mine["instances"]["1"]
        assert set(entry) == {"longest_matched", "dp"} and entry["longest_matched"] == 12 * BS
        rank = entry["dp"]["0"]
        assert {k: rank[k] for k in ("gpu", "cpu", "disk", "shared")} == {
            "gpu": 2 * BS,
            "cpu": 5 * BS,
            "disk": 12 * BS,
            "shared": 12 * BS,
        }
        assert {"weighted", "state"} <= set(rank)
    finally:
        engine.close()
