"""Reference counts and allocations of the seven C extensions: each entry point called in a
loop, good arguments and bad (wrong types, wrong lengths, values that do not fit, closed
or empty objects), leaves the interpreter's allocated blocks (``sys.getallocatedblocks``,
which counts every ``PyMem``/object allocation the extensions make) and its GC-tracked
objects where they were. A leaked reference or buffer per call would show as thousands.

``KVOFFLOAD_LEAK_ROUNDS`` scales the rounds (``make test`` runs a few thousand calls per
entry point; the issue's hundreds of thousands: ``KVOFFLOAD_LEAK_ROUNDS=100``). Under
``make test-sanitize`` (``PYTHONMALLOC=malloc``) the block count is not kept and only the
object count is compared; LeakSanitizer covers the raw allocations there.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import tempfile
import threading

import numpy as np
import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import RequestContext
from kvoffload.policies import available_policies

pytestmark = pytest.mark.timeout(600)

SCALE = float(os.environ.get("KVOFFLOAD_LEAK_ROUNDS", "1"))
SLACK = 64  # blocks or objects a warm interpreter may still move (caches, free lists)


def flat(one_round, rounds: int) -> None:
    """Run ``one_round`` until warm, then ``rounds`` times more: the allocated blocks and the
    GC-tracked objects after are those before, within ``SLACK``."""
    rounds = max(1, round(rounds * SCALE))
    for _ in range(max(3, rounds // 10)):
        one_round()
    gc.collect()
    blocks, objects = sys.getallocatedblocks(), len(gc.get_objects())
    for _ in range(rounds):
        one_round()
    gc.collect()
    grown = sys.getallocatedblocks() - blocks, len(gc.get_objects()) - objects
    assert grown[0] < SLACK and grown[1] < SLACK, f"{rounds} rounds grew (blocks, objects) by {grown}"


ARGUMENT_ERRORS = (TypeError, ValueError, OverflowError, KeyError, BufferError)


def refused(call, *errors) -> None:
    try:
        call()
    except errors or ARGUMENT_ERRORS:  # noqa: B030 - a tuple either way
        return
    raise AssertionError(f"{call} was not refused")


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def native(module: str):
    try:
        return __import__(f"kvoffload.{module}", fromlist=["x"])
    except ImportError:
        pytest.skip(f"kvoffload.{module} was not built (no C compiler at install)")


# -- policies._blocks -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", available_policies())
def test_blocks_through_every_policy(policy):
    blocks = native("policies._blocks")
    m = CPUOffloadingManager(16, policy, enable_events=True)
    keys = [k(i) for i in range(40)]
    state = {"i": 0}

    def one_round():
        i = state["i"] = state["i"] + 1
        ks = keys[i % 20 : i % 20 + 1 + i % 9]
        ctx = RequestContext(str(i % 5))
        m.on_new_request(ctx)
        h = m.lookup_prefix(ks)
        m.touch(ks)
        if h:
            m.prepare_load(ks[:h])
            m.complete_load(ks[:h])
        out = m.prepare_store(ks[h:])
        if out is not None:
            m.complete_store(out.keys_to_store, success=i % 7 != 0)
        m.on_request_finished(ctx, [ks], frozenset(), frozenset(ks[:h]))
        m.take_events()
        if i % 50 == 0:
            m.reset()

    flat(one_round, 3000)
    table = {}
    order = blocks.Order()

    def errors():
        refused(lambda: blocks.lookup_prefix(table, 5))
        refused(lambda: blocks.pin([], keys))
        refused(lambda: blocks.reserve(table, keys[:2], [1]))
        refused(lambda: blocks.release(table, keys[:1], None))
        refused(lambda: order.insert_many(keys[:2], [blocks.BlockStatus(0)]))
        refused(lambda: order.evictable("x", ()))
        refused(lambda: order.arc_touch(None, None, None, keys, 0, 0))
        refused(lambda: blocks.BlockStatus("slot"))
        assert blocks.unpin(table, keys[:1]) is None
        assert order.remove(keys[0]) is False

    flat(errors, 2000)


# -- scheduler._passes ------------------------------------------------------------------------


def test_passes():
    passes = native("scheduler._passes")
    ids = [f"req-{i}" for i in range(64)]
    before = list(range(64))
    scheduled = {rid: 1 for rid in ids[::2]}
    store_at = {rid: 10.0 + i for i, rid in enumerate(ids[::3])}

    class State:
        def __init__(self):
            self.block_ids = [[], []]

    requests = {rid: State() for rid in ids[::4]}

    def one_round():
        passes.tokens_after(ids, before, scheduled)
        passes.note_running(ids, before, {}, store_at)
        passes.advance_below(before, before, 1.0)
        passes.append_blocks(ids, [[[1], [2]] if i % 3 else None for i in range(64)], requests)
        for state in requests.values():
            state.block_ids = [[], []]
        refused(lambda: passes.tokens_after(ids, before[:3], scheduled))
        refused(lambda: passes.tokens_after(ids, before, []))
        refused(lambda: passes.note_running(ids, ["x"] * 64, {}, store_at))
        refused(lambda: passes.advance_below(before, before[:1], 1.0))
        refused(lambda: passes.append_blocks(ids, [None], requests))
        refused(lambda: passes.append_blocks(5, 6, requests))

    flat(one_round, 2000)


# -- tiers.fs._slotfind -----------------------------------------------------------------------


def test_slotfind():
    slotfind = native("tiers.fs._slotfind")
    from kvoffload.tiers.fs.index import SlotIndex
    from kvoffload.tiers.fs.order import SlotLRU

    index = SlotIndex(64, 36, native=True)
    state_array = np.zeros(64, dtype=np.int32)
    lru = SlotLRU(64, index, memoryview(state_array))
    keys = [k(i) for i in range(64)]

    class Status:
        ref = 0

    table = {keys[i]: Status() for i in range(0, 64, 5)}
    lookup = slotfind.TieredLookup(table, (index.finder,), lambda key: "slow", "hit", "miss", "pending")

    def one_round():
        index.insert_many(keys[:32], list(range(32)))
        lru.insert(keys[:32], list(range(32)))
        index.find(keys[3])
        index.split(keys[:40])
        index.keys_of([0, 1, 2])
        lru.touch(keys[::3])
        lru.evict(4, set(), frozenset()) if hasattr(lru, "evict") else None
        for key in keys[30:40]:
            lookup.lookup(key)
        lookup.take_counts()
        for slot in range(32):
            lru.remove(keys[slot], slot) if False else None
        index.clear()
        lru.clear()
        refused(lambda: index.finder.find(5))
        refused(lambda: index.finder.split(5))
        refused(lambda: index.finder.remove([999]))
        refused(lambda: index.finder.keys_of(["x"]))
        refused(
            lambda: slotfind.Finder(
                np.zeros(3), np.zeros(3, np.uint8), bytearray(4), np.zeros(1, np.uint8), 4
            )
        )
        refused(lambda: slotfind.TieredLookup({}, [index.finder], None, 1, 2, 3))

    flat(one_round, 1500)


# -- tiers.fs._runread ------------------------------------------------------------------------


def test_runread():
    native("tiers.fs._runread")
    from kvoffload.tiers.fs import block_io
    from kvoffload.tiers.fs.block_io import BlockFiles, CorruptBlock
    from kvoffload.tiers.fs.format import Geometry

    digest = bytes(16)
    with tempfile.TemporaryDirectory() as ns_dir:
        files = BlockFiles(ns_dir, Geometry(256), digest)
        keys = [k(i) for i in range(4)]
        files.write_run(0, keys, [[bytes([i]) * 256] for i in range(4)])
        rows = [[bytearray(100), bytearray(156)] for _ in keys]
        read_run = block_io._runread.read_run

        def one_round():
            files.read_run(0, keys, rows)
            with contextlib.suppress(CorruptBlock):
                files.read_run(0, keys[::-1], rows)
            block_io._runread.crc32c(b"abc", 5)
            h, d = files.header_fd, files.data_fd
            refused(lambda: read_run(h, d, 0, keys, rows, b"short", 1, 256, 0, 4096))
            refused(lambda: read_run(h, d, 0, keys[:2], rows, digest, 1, 256, 0, 4096))
            refused(lambda: read_run(h, d, 0, [5] * 4, rows, digest, 1, 256, 0, 4096))
            refused(lambda: read_run(h, d, 0, keys, [[b"read-only"]] * 4, digest, 1, 256, 0, 4096))
            refused(lambda: read_run(h, d, 0, keys, [[bytearray(3)]] * 4, digest, 1, 256, 0, 4096))
            refused(lambda: read_run(h, d, 2**62, keys, rows, digest, 1, 256, 0, 4096))
            assert read_run(-1, d, 0, keys, rows, digest, 1, 256, 0, 4096)[1] == 3  # EBADF

        flat(one_round, 2000)
        files.close()


# -- index._hashfind --------------------------------------------------------------------------


def test_hashfind():
    hashfind = native("index._hashfind")
    from kvoffload.index.requests import BadRequest, parse

    table = np.zeros((8, 8), dtype=np.uint64)
    table[3, 2] = 7
    hashes = np.arange(100, dtype=np.uint64)
    out = np.empty(100, dtype=np.intp)
    body = b'{"model_name": "m", "block_hashes": [1, 2, 18446744073709551615, -5]}'

    def one_round():
        hashfind.parse_hashes(b"[1, 2, 3, -9223372036854775808]")
        hashfind.parse_hashes(b"[" + b"7," * 3000 + b"7]")  # grown past its first buffer
        assert hashfind.parse_hashes(b"[1, 2.5]") is None
        assert hashfind.parse_hashes(b"[18446744073709551616]") is None
        hashfind.find(table, hashes, 61, out)
        parse("query_by_hash", body)
        refused(lambda: parse("query_by_hash", b'{"model_name": "m", "block_hashes": [1e3]}'), BadRequest)
        refused(lambda: hashfind.parse_hashes(5))
        refused(lambda: hashfind.find(table, hashes, 0, out))
        refused(lambda: hashfind.find(table, hashes, 60, out))
        refused(lambda: hashfind.find(table, hashes, 61, out[:5]))
        refused(lambda: hashfind.find(table, hashes[:-1].view(np.uint8)[3:], 61, out))

    flat(one_round, 3000)


# -- transfer._rowcopy ------------------------------------------------------------------------


def test_rowcopy():
    rowcopy = native("transfer._rowcopy")
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    offsets = np.array([0, 1024, 2048], dtype=np.int64)
    lengths = np.array([512, 1024, 2048], dtype=np.int64)
    addrs = (dst.ctypes.data, src.ctypes.data, offsets.ctypes.data, offsets.ctypes.data, lengths.ctypes.data)

    def one_round():
        rowcopy.copy_runs(*addrs, 3, True)
        rowcopy.copy_runs(*addrs, 3, False)
        refused(lambda: rowcopy.copy_runs(*addrs, 3))
        refused(lambda: rowcopy.copy_runs(*addrs, -1, True))
        refused(lambda: rowcopy.copy_runs("dst", *addrs[1:], 3, True))

    flat(one_round, 5000)
    assert dst[:512].tolist() == src[:512].tolist()


# -- tiers.redis._pipelines -------------------------------------------------------------------


class Server:
    """The far end of a socket pair that answers every command it reads with ``reply``."""

    def __init__(self, reply) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.ours.settimeout(10)
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while data := self.theirs.recv(1 << 16):
                self.theirs.sendall(self.reply(data))
        except OSError:
            pass

    def close(self) -> None:
        self.ours.close()
        self.thread.join(10)
        self.theirs.close()


def test_pipelines():
    native("tiers.redis._pipelines")
    from kvoffload.tiers.redis import pipelines
    from kvoffload.tiers.redis._pipelines import Completions, JobQueue, crc32c, get_into, set_nx
    from kvoffload.tiers.redis.format import encode
    from kvoffload.tiers.redis.resp import RespStream

    digest = bytes(16)
    key = k(1)
    payload = [bytes(range(200)), bytes(56)]
    value = encode(key, payload, digest)
    get_reply = b"$%d\r\n%s\r\n" % (len(value), value)
    server = Server(lambda data: get_reply * data.count(b"GET") + b"+OK\r\n" * data.count(b"SET"))
    stream = RespStream(server.ours)
    fd = server.ours.fileno()
    rows = [memoryview(bytearray(200)), memoryview(bytearray(56))]
    items = [(b"n", key, rows)] * 3
    completions = Completions()

    def one_round():
        assert pipelines.get_into(stream, items, digest) == [True] * 3
        assert pipelines.set_nx(stream, [(b"n", key, payload)] * 2, digest) == [b"OK"] * 2
        crc32c(b"abcd", 3)
        request, plan = pipelines.planned_get(items, digest)
        queue = JobQueue(completions)
        buffers, checksums = pipelines.planned_set_nx([(b"n", key, payload)], digest, None, True)
        queue.push_set("unsent", buffers, 1, checksums)
        assert queue.drain() == ["unsent"]
        queue.push_get("token", request, plan)
        queue.push_set("set", buffers, 1, checksums)
        queue.push_get("again", request, plan)
        queue.close()
        assert queue.serve(fd, 10.0) is None
        assert [token for token, _ in queue.collect()] == ["token", "set", "again"]
        refused(lambda: queue.push_get("late", request, plan), RuntimeError)
        refused(lambda: get_into(fd, 1.0, b"", b"", [(b"short", 0, b"k", [])]))
        refused(lambda: get_into(fd, 1.0, b"", b"", [("not bytes", 0, b"k", [])]))
        refused(lambda: get_into(fd, 1.0, b"", b"x" * 10**4, plan))
        refused(
            lambda: get_into(fd, 1.0, b"", b"", [(plan[0][0], 5, key, [b"read-only"])]),
            TypeError,
            BufferError,
        )
        refused(lambda: set_nx(fd, 1.0, [b"x"], b"", 1, [(5, 0, 0, 0)]))
        refused(lambda: set_nx(fd, 1.0, [b"x" * 10], b"", 1, [(0, 0, 0, 0)]), TypeError)
        refused(lambda: set_nx(fd, 1.0, [b"x"], b"", 1, ["bad"]))
        refused(lambda: completions.wait(0, -1.0))
        refused(lambda: JobQueue(5))
        completions.wait(completions.count, 0.0)

    try:
        flat(one_round, 1500)
    finally:
        server.close()
