"""The C functions that release the GIL, with other Python threads changing what they were
handed meanwhile.

Each holds what it reads without the GIL: buffers through buffer views (a ``bytearray``
cannot be resized while one is held), the plan's items and keys through a tuple of its
own (the caller's list may be emptied, its bytes freed and their memory reused), a queued
store through its queue, even while another thread takes the queue out. ``_rowcopy``
gets addresses, not objects: that the memory outlives the copy is its caller's contract
(``transfer.row_plan``), nothing a thread could break through the call.

Several of these failed before the fixes they name (a use after free shows as wrong
answers here, and as a report under ``make test-sanitize``).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from kvoffload.keys import make_offload_key

pytestmark = pytest.mark.timeout(120)


def native(module: str):
    try:
        return __import__(f"kvoffload.{module}", fromlist=["x"])
    except ImportError:
        pytest.skip(f"kvoffload.{module} was not built (no C compiler at install)")


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def churn(go: threading.Event, stop: threading.Event, *lists: list) -> threading.Thread:
    """A thread that, from ``go`` on, keeps emptying ``lists`` (of bytes) and filling the
    freed memory with other bytes of the same sizes, until ``stop``."""
    sizes = sorted({len(x) for lst in lists for x in lst})

    def run() -> None:
        go.wait()
        junk = []
        while not stop.is_set():
            for lst in lists:
                lst.clear()
            junk = [bytes([0xA5]) * n for n in sizes for _ in range(64)]
            time.sleep(0)
        del junk

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def into(out: dict, call, *args) -> None:
    out["out"] = call(*args)


@contextlib.contextmanager
def gil_kept_until_released():
    """No switch of the GIL between threads but where a thread releases it: a call that
    releases it in C is entered, its arguments taken, before another thread runs."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_get_into_holds_its_plan_while_another_thread_empties_the_list():
    """Fixed: the batch kept the caller's list, not its items; a thread emptying the list
    while the replies were awaited freed each item's planned bytes and key, which the C
    batch then compared the replies with (a read after free: values answered as foreign)."""
    native("tiers.redis._pipelines")
    from kvoffload.tiers.redis import pipelines
    from kvoffload.tiers.redis._pipelines import get_into
    from kvoffload.tiers.redis.format import encode

    digest = bytes(16)
    for attempt in range(20):
        keys = [bytes([attempt]) + k(i)[1:] for i in range(8)]
        payload = [bytes(range(64))]
        reply = b"".join(
            b"$%d\r\n%s\r\n" % (len(v), v) for v in (encode(key, payload, digest) for key in keys)
        )
        rows = [[memoryview(bytearray(64))] for _ in keys]
        named = [(b"n%d" % i, key, r) for i, (key, r) in enumerate(zip(keys, rows))]
        request, plan = pipelines.planned_get(named, digest)
        # the plan's bytes and keys are its own objects, freed when the list lets go of them
        plan = [(bytes(bytearray(e)), lead, bytes(bytearray(key)), r) for e, lead, key, r in plan]
        ours, theirs = socket.socketpair()
        ours.settimeout(10)
        result = {}
        batch = threading.Thread(
            target=into, args=(result, get_into, ours.fileno(), 10.0, request, b"", plan)
        )
        batch.start()
        got = b""
        while len(got) < len(request):  # sent: the batch waits for its replies without the GIL
            got += theirs.recv(1 << 16)
        sizes = {len(e) for e, *_ in plan} | {len(key) for _, _, key, _ in plan}
        plan.clear()
        junk = [bytes([0xA5]) * n for n in sizes for _ in range(256)]  # the freed memory, reused
        theirs.sendall(reply)
        batch.join(10)
        ours.close()
        theirs.close()
        del junk
        assert result["out"] == ([True] * 8, b""), attempt


def test_a_queued_load_holds_its_plan_after_the_caller_dropped_it():
    """Fixed with the above: a queued batch runs long after ``push_get`` returned."""
    native("tiers.redis._pipelines")
    from kvoffload.tiers.redis import pipelines
    from kvoffload.tiers.redis._pipelines import Completions, JobQueue
    from kvoffload.tiers.redis.format import encode

    digest = bytes(16)
    keys = [k(i) for i in range(8)]
    payload = [bytes(range(64))]
    reply = b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in (encode(key, payload, digest) for key in keys))
    queue = JobQueue(Completions())
    for attempt in range(20):
        rows = [[memoryview(bytearray(64))] for _ in keys]
        request, plan = pipelines.planned_get([(b"n", key, r) for key, r in zip(keys, rows)], digest)
        plan = [(bytes(bytearray(e)), lead, bytes(bytearray(key)), r) for e, lead, key, r in plan]
        queue.push_get(attempt, request, plan)
        sizes = {len(e) for e, *_ in plan} | {len(key) for _, _, key, _ in plan}
        plan.clear()
        junk = [bytes([0x5A]) * n for n in sizes for _ in range(256)]
        ours, theirs = socket.socketpair()
        ours.settimeout(10)
        theirs.sendall(reply)
        queue.close()
        served = threading.Thread(target=queue.serve, args=(ours.fileno(), 10.0))
        served.start()
        served.join(10)
        ((token, (results, unread)),) = queue.collect()
        assert token == attempt and results == [True] * 8, results
        ours.close()
        theirs.close()
        del junk
        queue = JobQueue(Completions())


def test_drain_while_the_serving_thread_fills_in_a_queued_stores_checksums():
    """Fixed: the serving thread filled in the next queued store's CRC32Cs (after sending the
    batch before it) while ``drain()`` on another thread could take that store out and free
    it (the queue's own contract said only the serving thread took jobs off). ``drain`` now
    waits for the checksums, so every store it hands back is whole; under ASan the old race
    was a heap use after free."""
    native("tiers.redis._pipelines")
    from kvoffload.tiers.redis import pipelines
    from kvoffload.tiers.redis._pipelines import Completions, JobQueue

    digest = bytes(16)
    big = [bytearray(8 << 20)]  # a CRC32C of 8 MiB: milliseconds for the drain to land in
    for attempt in range(10):
        queue = JobQueue(Completions())
        ours, theirs = socket.socketpair()
        ours.settimeout(10)
        buffers, checksums = pipelines.planned_set_nx([(b"first", k(1), [b"x"])], digest, None, True)
        queue.push_set("first", buffers, 1, checksums)
        buffers, checksums = pipelines.planned_set_nx([(b"big", k(2), big)], digest, None, True)
        queue.push_set("big", buffers, 1, checksums)
        out = {}
        server = threading.Thread(target=into, args=(out, queue.serve, ours.fileno(), 10.0))
        server.start()
        time.sleep(0.001 * attempt)
        drained = queue.drain()
        queue.close()
        theirs.sendall(b"+OK\r\n+OK\r\n")
        server.join(10)
        assert drained in ([], ["big"], ["first", "big"])
        ours.close()
        theirs.close()


WAIT_AND_BUMP = """
import sys, threading, time
from kvoffload.tiers.redis._pipelines import Completions
for timeout in (float("inf"), 1e300, 1e12):
    completions = Completions()
    out = {}
    waiter = threading.Thread(target=lambda: out.update(moved=completions.wait(0, timeout)), daemon=True)
    waiter.start()
    time.sleep(0.1)
    completions.bump()
    waiter.join(30)
    assert out.get("moved") is True, timeout
"""


def test_a_wait_without_a_deadline_is_woken_by_a_bump():
    """Fixed: a timeout too large for a timespec (``inf``) was converted anyway (undefined),
    ``pthread_cond_timedwait`` refused it at once without ever releasing the mutex, and the
    wait spun holding it: ``bump()`` (which takes the mutex with the GIL held) never got in,
    and the whole process hung. Run in a process of its own, so that a hang fails the test."""
    native("tiers.redis._pipelines")
    from kvoffload.tiers.redis._pipelines import Completions

    done = subprocess.run([sys.executable, "-c", WAIT_AND_BUMP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(ValueError, match="nan"):
        Completions().wait(0, float("nan"))


def test_read_run_holds_its_keys_while_another_thread_empties_the_list():
    """Fixed: the keys went through ``PySequence_Fast``, which hands a list back as it is:
    a thread emptying it during the reads freed the keys the records were compared with."""
    native("tiers.fs._runread")
    from kvoffload.tiers.fs import block_io
    from kvoffload.tiers.fs.block_io import BlockFiles
    from kvoffload.tiers.fs.format import FORMAT_VERSION, Geometry

    digest = bytes(16)
    n = 256
    with tempfile.TemporaryDirectory() as ns_dir:
        files = BlockFiles(ns_dir, Geometry(4096), digest)
        try:
            written = [bytes(bytearray(k(i))) for i in range(n)]
            files.write_run(0, written, [[bytes([i % 251]) * 4096] for i in range(n)])
            for _ in range(20):
                keys = [bytes(bytearray(key)) for key in written]  # objects only this list holds
                rows = [[bytearray(4096)] for _ in range(n)]
                go, stop = threading.Event(), threading.Event()
                thread = churn(go, stop, keys)
                try:
                    with gil_kept_until_released():
                        go.set()  # it runs once the call below releases the GIL
                        done, status, value = block_io._runread.read_run(
                            files.header_fd,
                            files.data_fd,
                            0,
                            keys,
                            rows,
                            digest,
                            FORMAT_VERSION,
                            4096,
                            0,
                            4096,
                        )
                finally:
                    stop.set()
                    thread.join(10)
                assert (done, status) == (n, 0), (done, status, value)
        finally:
            files.close()


@pytest.mark.parametrize("module", ["tiers.fs._runread", "tiers.redis._pipelines"])
def test_a_buffer_being_checksummed_cannot_be_resized(module):
    """Another thread grows and shrinks the buffer by a byte as fast as it can: while a
    checksum reads it without the GIL the buffer is exported (``BufferError``), so each
    call sees it whole, with or without that byte, never moved or freed under it."""
    crc32c = native(module).crc32c
    data = bytearray(range(256)) * (64 << 10)  # 16 MiB
    states = {crc32c(bytes(data)), crc32c(bytes(data) + b"x")}
    stop = threading.Event()

    def resize() -> None:
        while not stop.is_set():
            try:
                data.extend(b"x")
            except BufferError:
                continue
            while True:  # the byte goes again before the next one can come
                try:
                    del data[-1:]
                    break
                except BufferError:
                    pass

    thread = threading.Thread(target=resize)
    thread.start()
    try:
        for _ in range(20):
            assert crc32c(data) in states
    finally:
        stop.set()
        thread.join(10)
