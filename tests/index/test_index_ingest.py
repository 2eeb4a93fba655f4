"""Ingestion over real ZMQ sockets: sources stay EXACT, repair gaps by replay, report what
they cannot repair as DEGRADED, and start over when their publisher restarts.

Live streams with chosen gaps come from an XPUB socket speaking the publisher's wire
format (it tells when the subscription has arrived, so what it sends is received live);
replays come from a real ``ZmqEventPublisher`` holding the same batches."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvoffload.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    KVEventBatch,
    ZmqEventPublisher,
    encode,
)
from kvoffload.index import IndexService, Registration, SourceState

pytestmark = pytest.mark.timeout(60)

MODEL, BS = "m", 16


def stored(hashes, medium="GPU", locality=None) -> BlockStored:
    return BlockStored(list(hashes), None, [], BS, None, medium, None, locality=locality)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def levels(service: IndexService, hashes, tenant="default") -> dict[tuple, tuple]:
    result = service.index.query_hashes(MODEL, tenant, hashes)
    return {(m.instance_id, m.dp_rank): m.levels for m in result.matches}


@pytest.fixture
def service() -> Iterator[IndexService]:
    with IndexService(replay_timeout=0.5, idle_catch_up=0.2) as svc:
        yield svc


class FakeLive:
    """The live half of a publisher: sends chosen sequence numbers of chosen batches."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.bind(endpoint)

    def wait_subscribed(self) -> None:
        assert self.sock.poll(10_000), "the source never subscribed"
        assert self.sock.recv() == b"\x01"

    def send(self, seq: int, batch: KVEventBatch | bytes) -> None:
        payload = batch if isinstance(batch, bytes) else encode(batch)
        self.sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close(linger=0)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(1.0, list(events), 0)


def test_two_publishers_multi_tier_are_indexed_exactly(tmp_path: Path, service: IndexService) -> None:
    h = list(range(1, 9))
    with (
        ZmqEventPublisher(f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/ar") as a,
        ZmqEventPublisher(f"ipc://{tmp_path}/b", f"ipc://{tmp_path}/br", data_parallel_rank=0) as b,
    ):
        a.publish([stored(h[:3]), stored(h, "CPU")])  # before registration: backfilled by replay
        src_a = service.register(Registration("a", a.endpoint, MODEL, BS, replay_endpoint=a.replay_endpoint))
        src_b = service.register(
            Registration(2, b.endpoint, MODEL, BS, dp_rank=1, replay_endpoint=b.replay_endpoint)
        )
        b.publish([stored(h[:5]), stored(h[:2], "STORAGE", "LOCAL")])
        b.publish([BlockRemoved(h[4:5], "GPU"), stored(h[4:7], "STORAGE", "REMOTE")])
        a.publish([stored(h[3:4], "STORAGE")])
        wait_for(lambda: src_a.stats().batches == 2 and src_b.stats().batches == 2, "both streams")
    assert levels(service, h) == {("a", 0): (3, 8, 8, 8), (2, 1): (4, 4, 4, 7)}
    assert src_a.state is src_b.state is SourceState.EXACT
    assert src_a.stats().lost == src_b.stats().lost == 0


def test_a_gap_is_repaired_by_replay_and_the_source_stays_exact(
    tmp_path: Path, service: IndexService
) -> None:
    live_ep, replay_ep = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"
    live = FakeLive(live_ep)
    try:
        with ZmqEventPublisher(f"ipc://{tmp_path}/unused", replay_ep) as buffer:
            source = service.register(Registration("e", live_ep, MODEL, BS, replay_endpoint=replay_ep))
            live.wait_subscribed()
            wait_for(lambda: source.state is SourceState.EXACT, "the empty publisher's replay answer")
            batches = [batch(stored([100 + i])) for i in range(6)]
            for b in batches:
                buffer.publish(b)
            for seq in (0, 1, 5):  # 2, 3 and 4 never arrive live
                live.send(seq, batches[seq])
            wait_for(lambda: source.stats().batches == 6, "all six batches")
            wait_for(lambda: source.stats().gaps_repaired == 1, "the replay run to end")
    finally:
        live.close()
    assert levels(service, [100 + i for i in range(6)]) == {("e", 0): (6, 6, 6, 6)}
    assert source.state is SourceState.EXACT
    stats = source.stats()
    assert (stats.gaps, stats.lost, stats.degraded) == (0, 0, 0)
    assert source.subscriber_stats()["replayed"] >= 3


def test_a_gap_beyond_the_replay_buffer_degrades_until_a_clear(tmp_path: Path, service: IndexService) -> None:
    live_ep, replay_ep = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"
    live = FakeLive(live_ep)
    try:
        with ZmqEventPublisher(f"ipc://{tmp_path}/unused", replay_ep, buffer_steps=2) as buffer:
            source = service.register(Registration("e", live_ep, MODEL, BS, replay_endpoint=replay_ep))
            live.wait_subscribed()
            batches = [batch(stored([100 + i])) for i in range(6)]
            live.send(0, batches[0])
            live.send(1, batches[1])
            wait_for(lambda: source.stats().batches == 2, "batches 0 and 1")
            for b in batches:
                buffer.publish(b)  # the buffer keeps only 4 and 5
            live.send(5, batches[5])  # (an idle catch-up may see the gap first: same outcome)
            wait_for(lambda: source.stats().batches == 4, "batches 0, 1, 4 and 5")
            assert source.state is SourceState.DEGRADED
            result = service.index.query_hashes(MODEL, "default", [100, 101])
            assert result.matches[0].state is SourceState.DEGRADED and result.matches[0].levels[0] == 2
            clear = batch(AllBlocksCleared(), stored([7]))
            buffer.publish(clear)
            live.send(6, clear)
            wait_for(lambda: source.stats().batches == 5, "the clear")
    finally:
        live.close()
    assert source.state is SourceState.EXACT
    stats = source.stats()
    assert (stats.gaps, stats.lost, stats.degraded) == (1, 2, 1)
    assert levels(service, [100, 101]) == {("e", 0): (0, 0, 0, 0)}
    assert levels(service, [7]) == {("e", 0): (1, 1, 1, 1)}


def test_without_a_replay_endpoint_every_gap_degrades(tmp_path: Path, service: IndexService) -> None:
    live_ep = f"ipc://{tmp_path}/live"
    live = FakeLive(live_ep)
    try:
        source = service.register(Registration("e", live_ep, MODEL, BS))
        assert source.state is SourceState.FALLBACK  # nothing heard yet
        live.wait_subscribed()
        live.send(0, batch(stored([1])))
        wait_for(lambda: source.state is SourceState.EXACT, "the first batch")
        live.send(3, batch(stored([2])))
        wait_for(lambda: source.stats().batches == 2, "the batch after the gap")
    finally:
        live.close()
    assert source.state is SourceState.DEGRADED and source.stats().lost == 2


def test_malformed_messages_are_counted_and_an_undecodable_batch_degrades(
    tmp_path: Path, service: IndexService
) -> None:
    live_ep, replay_ep = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"
    live = FakeLive(live_ep)
    try:
        with ZmqEventPublisher(f"ipc://{tmp_path}/unused", replay_ep) as buffer:
            source = service.register(Registration("e", live_ep, MODEL, BS, replay_endpoint=replay_ep))
            live.wait_subscribed()
            batches = [batch(stored([10 + i])) for i in range(3)]
            for b in batches:
                buffer.publish(b)
            live.send(0, batches[0])
            live.sock.send_multipart([b"", b"short", encode(batches[1])])  # no sequence number
            live.send(2, batches[2])  # seq 1 is missing: replayed from the buffer
            wait_for(lambda: source.stats().batches == 3, "batches 0 to 2")
            assert source.state is SourceState.EXACT
            live.send(3, b"\xc1 not msgpack")  # a sequence number, but no batch in it
            wait_for(lambda: source.state is SourceState.DEGRADED, "the undecodable batch")
    finally:
        live.close()
    assert source.subscriber_stats()["malformed"] == 2
    assert source.stats().degraded == 1
    assert levels(service, [10, 11, 12, 13]) == {("e", 0): (3, 3, 3, 3)}


def test_a_publisher_restart_drops_its_entries_and_starts_over(tmp_path: Path, service: IndexService) -> None:
    live_ep = f"ipc://{tmp_path}/live"
    live = FakeLive(live_ep)
    try:
        source = service.register(Registration("e", live_ep, MODEL, BS))
        other = service.register(Registration("o", f"ipc://{tmp_path}/nobody", MODEL, BS))
        live.wait_subscribed()
        for seq in range(4):
            live.send(seq, batch(stored([seq + 1]), stored([seq + 1], "CPU")))
        wait_for(lambda: source.stats().batches == 4, "the first lifetime")
        assert levels(service, [1, 2, 3, 4])[("e", 0)] == (4, 4, 4, 4)
        # The restarted publisher numbers its batches from 0 again.
        live.send(0, batch(stored([50])))
        live.send(1, batch(stored([51], "CPU")))
        wait_for(lambda: source.stats().batches == 6, "the second lifetime")
    finally:
        live.close()
    assert source.stats().restarts == 1 and source.state is SourceState.EXACT
    assert levels(service, [1, 2, 3, 4])[("e", 0)] == (0, 0, 0, 0)
    assert levels(service, [50, 51]) == {("e", 0): (1, 2, 2, 2), ("o", 0): (0, 0, 0, 0)}
    assert source.engine.blocks == [1, 1, 0, 0]
    assert other.state is SourceState.FALLBACK


def test_a_real_publisher_killed_and_restarted_is_followed(tmp_path: Path, service: IndexService) -> None:
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    with ZmqEventPublisher(endpoint, replay) as first:
        source = service.register(Registration("e", endpoint, MODEL, BS, replay_endpoint=replay))
        for i in range(10):
            first.publish([stored([1000 + i])])
        wait_for(lambda: source.stats().batches == 10, "the first publisher's batches")
    with ZmqEventPublisher(endpoint, replay) as second:
        sent = 0
        while source.stats().restarts == 0:
            assert sent < 10, "the restart was never noticed"
            second.publish([stored([2000 + sent])])
            sent += 1
            deadline = time.monotonic() + 1.0
            while source.stats().restarts == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        wait_for(lambda: source.stats().batches >= 10 + sent, "the second publisher's batches")
        wait_for(lambda: source.engine.blocks[0] == sent, "every batch of the new lifetime")
    assert source.state is SourceState.EXACT and source.stats().lost == 0
    assert levels(service, [1000])[("e", 0)] == (0, 0, 0, 0)
    assert levels(service, [2000 + i for i in range(sent)])[("e", 0)] == (sent,) * 4


def test_unregister_stops_the_source_and_forgets_its_entries(tmp_path: Path, service: IndexService) -> None:
    with ZmqEventPublisher(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r") as pub:
        pub.publish([stored([1, 2])])
        source = service.register(
            Registration("e", pub.endpoint, MODEL, BS, replay_endpoint=pub.replay_endpoint)
        )
        keep = service.register(
            Registration("k", pub.endpoint, MODEL, BS, replay_endpoint=pub.replay_endpoint)
        )
        wait_for(lambda: source.stats().batches == keep.stats().batches == 1, "the batch")
        with pytest.raises(LookupError, match="'e' of model 'm' tenant 'acme'"):
            service.unregister("e", MODEL, "acme")
        (removed,) = service.unregister("e", MODEL)
    assert removed[0].instance_id == "e"
    assert levels(service, [1, 2]) == {("k", 0): (2, 2, 2, 2)}
    assert [reg.instance_id for reg, _ in service.sources()] == ["k"]


def test_registration_errors_name_the_field(service: IndexService) -> None:
    with pytest.raises(ValueError, match="endpoint.*'udp://x'"):
        Registration("e", "udp://x", MODEL, BS)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        Registration("e", "tcp://127.0.0.1:5", MODEL, 0)
    with pytest.raises(ValueError, match="instance_id"):
        Registration(True, "tcp://127.0.0.1:5", MODEL, BS)  # type: ignore[arg-type]
    service.register(Registration("e", "tcp://127.0.0.1:5", MODEL, BS))
    with pytest.raises(ValueError, match="already registered"):
        service.register(Registration("e", "tcp://127.0.0.1:6", MODEL, BS))
    with pytest.raises(ValueError, match="block_size 32 differs"):
        service.register(Registration("f", "tcp://127.0.0.1:6", MODEL, 32))


def test_deliveries_say_their_lifetime_the_gap_before_them_and_their_origin(tmp_path: Path) -> None:
    live_ep, replay_ep = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"
    live = FakeLive(live_ep)
    try:
        with (
            ZmqEventPublisher(f"ipc://{tmp_path}/unused", replay_ep, buffer_steps=2) as buffer,
            EventSubscriber(live_ep, replay_ep, replay_timeout=0.5) as sub,
        ):
            deadline = time.monotonic() + 10
            while not live.sock.poll(10):
                assert sub.receive_delivery(0) is None
                assert time.monotonic() < deadline, "the subscriber never subscribed"
            assert live.sock.recv() == b"\x01"
            batches = [batch(stored([i])) for i in range(5)]
            live.send(0, batches[0])
            first = sub.receive_delivery(5)
            for b in batches:
                buffer.publish(b)  # keeps 3 and 4
            live.send(4, batches[4])
            got = [sub.receive_delivery(5), sub.receive_delivery(5)]
            live.send(0, batch(stored([99])))  # a restarted publisher
            restarted = sub.receive_delivery(5)
    finally:
        live.close()
    assert first is not None and (first.seq, first.epoch, first.gap, first.replayed) == (0, 0, 0, False)
    assert [(d.seq, d.epoch, d.gap, d.replayed) for d in got] == [(3, 0, 2, True), (4, 0, 0, True)]
    assert restarted is not None and (restarted.seq, restarted.epoch, restarted.gap) == (0, 1, 0)
    assert restarted.batch.events == [stored([99])]
    assert sub.pending_gap == 0 and sub.stats().replay_timeouts == 0
