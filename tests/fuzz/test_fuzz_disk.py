"""Fuzzing the disk tier's readers of its own files, which a crash, a torn write, a full
disk, another process or a bad sector may leave in any state: the header record parser
(``format.parse_record``) and a run's reads (``BlockFiles.read_run``) in C
(``kvoffload.tiers.fs._runread``) and in Python.

* ``parse_record`` takes any bytes: a ``Record`` or a ``RecordError``, nothing else; a
  record that parses is one ``pack_record`` could have written (a flipped byte anywhere in
  it is refused).
* Real files written by ``write_run``, then damaged (bytes of records and payloads
  changed, records zeroed, the data file cut short) and read back, with the keys written
  or others: the C and the Python reads agree on the outcome (the same ``CorruptBlock``:
  slot and reason, or success), and a run read without error holds the bytes written.
* ``_runread.read_run`` called with arguments of any size refuses the ones that do not fit
  (``ValueError``, ``TypeError``, ``OverflowError``) before it reads.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import TIMEOUT, fuzz
from kvoffload.tiers.fs import block_io
from kvoffload.tiers.fs.block_io import BlockFiles, CorruptBlock
from kvoffload.tiers.fs.format import (
    DATA_FILE,
    HEADER_FILE,
    MAX_KEY_BYTES,
    RECORD_BYTES,
    Geometry,
    Record,
    RecordError,
    pack_record,
    parse_record,
)

pytestmark = pytest.mark.timeout(TIMEOUT)

DIGEST = bytes(range(100, 116))
needs_c = pytest.mark.skipif(not block_io.native_reads(), reason="kvoffload.tiers.fs._runread not built")

key = st.binary(min_size=1, max_size=MAX_KEY_BYTES)
record = st.builds(
    pack_record, key, st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
    st.just(DIGEST),
)  # fmt: skip


@fuzz(1000)
@given(st.one_of(st.binary(max_size=2 * RECORD_BYTES), record))
def test_parse_record_takes_any_bytes(raw):
    try:
        parsed = parse_record(raw)
    except RecordError:
        return
    assert isinstance(parsed, Record)


@fuzz(500)
@given(record, st.integers(0, RECORD_BYTES - 1), st.integers(1, 255))
def test_a_record_with_any_byte_changed_is_refused(raw, at, xor):
    parse_record(raw)
    damaged = bytearray(raw)
    damaged[at] ^= xor
    with pytest.raises(RecordError):
        parse_record(bytes(damaged))


@contextlib.contextmanager
def python_reads():
    native, block_io._runread = block_io._runread, None
    try:
        yield
    finally:
        block_io._runread = native


def split(payload: bytes, cuts: list[int]) -> list[bytearray]:
    """``payload`` as rows cut at ``cuts`` (a block's host rows)."""
    edges = sorted({0, len(payload), *(c % (len(payload) + 1) for c in cuts)})
    return [bytearray(payload[a:b]) for a, b in zip(edges, edges[1:])]


@st.composite
def damaged_run(draw):
    payload = draw(st.sampled_from([1, 7, 100, 4000, 4096, 5000]))
    n = draw(st.integers(1, 4))
    first = draw(st.integers(0, 3))
    keys = [draw(key) for _ in range(n)]
    seeds = [draw(st.integers(0, 255)) for _ in range(n)]
    damage = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("record"), st.integers(0, n * RECORD_BYTES - 1), st.integers(1, 255)),
                st.tuples(st.just("payload"), st.integers(0, n * payload - 1), st.integers(1, 255)),
                st.tuples(st.just("zero"), st.integers(0, n - 1), st.just(0)),
                st.tuples(st.just("cut"), st.integers(0, n * payload + 2 * 4096), st.just(0)),
            ),
            max_size=3,
        )
    )
    read_keys = [draw(st.one_of(st.just(k), key)) if draw(st.booleans()) else k for k in keys]
    cuts = draw(st.lists(st.integers(0, payload), max_size=3))
    return payload, first, keys, seeds, damage, read_keys, cuts


def read_outcome(files: BlockFiles, first: int, keys: list[bytes], payload: int, cuts: list[int]):
    blocks = [split(bytes(payload), cuts) for _ in keys]
    try:
        files.read_run(first, keys, blocks)
    except CorruptBlock as exc:
        return ("corrupt", exc.slot, exc.reason)
    return ("ok", [b"".join(rows) for rows in blocks])


@needs_c
@fuzz(300)
@given(damaged_run())
def test_run_reads_in_c_and_in_python_agree_on_damaged_files(drawn):
    payload, first, keys, seeds, damage, read_keys, cuts = drawn
    written = [bytes((s + i) & 0xFF for i in range(payload)) for s in seeds]
    with tempfile.TemporaryDirectory() as ns_dir:
        geometry = Geometry(payload)
        files = BlockFiles(ns_dir, geometry, DIGEST)
        try:
            files.write_run(first, keys, [split(w, cuts) for w in written])
            for what, at, xor in damage:
                if what == "cut":
                    os.truncate(os.path.join(ns_dir, DATA_FILE), first * geometry.slot_stride + at)
                    continue
                if what == "zero":
                    files.invalidate(first + at)
                    continue
                if what == "record":
                    name, offset = HEADER_FILE, first * RECORD_BYTES + at
                else:
                    block, within = divmod(at, payload)
                    name, offset = DATA_FILE, (first + block) * geometry.slot_stride + within
                with open(os.path.join(ns_dir, name), "r+b") as f:
                    f.seek(offset)
                    byte = f.read(1) or b"\0"
                    f.seek(offset)
                    f.write(bytes([byte[0] ^ xor]))
            native = read_outcome(files, first, read_keys, payload, cuts)
            with python_reads():
                python = read_outcome(files, first, read_keys, payload, cuts)
        finally:
            files.close()
    assert native == python
    if native[0] == "ok":
        assert native[1] == written and read_keys == keys


@pytest.mark.parametrize("path", ["native", "python"])
def test_the_first_bad_block_of_a_run_is_the_one_named(path):
    """Found by fuzzing: the Python read checked every record of a run before reading any
    payload, so a run whose block 0 was cut short and whose block 1 had lost its record
    was reported as block 1, and the C read, block by block, as block 0 (each invalidates
    the slot it names)."""
    if path == "native" and not block_io.native_reads():
        pytest.skip("kvoffload.tiers.fs._runread not built")
    with tempfile.TemporaryDirectory() as ns_dir:
        files = BlockFiles(ns_dir, Geometry(100), DIGEST)
        try:
            keys = [b"a" * 36, b"b" * 36]
            files.write_run(5, keys, [[bytes(100)], [bytes(100)]])
            files.invalidate(6)
            os.truncate(os.path.join(ns_dir, DATA_FILE), 5 * 4096 + 50)
            with python_reads() if path == "python" else contextlib.nullcontext():
                outcome = read_outcome(files, 5, keys, 100, [])
        finally:
            files.close()
    assert outcome == ("corrupt", 5, "truncated: read 50 of 100 payload bytes")


ARG = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 128, 4096, 2**62, 2**63 - 1, -1]))


@needs_c
@fuzz(400)
@given(ARG, ARG, ARG, ARG, st.integers(0, 3), st.sampled_from([0, 16, 15]))
def test_read_run_refuses_arguments_that_do_not_fit(first, payload, offset, stride, n, digest_len):
    """Whatever the numbers, the call returns a status or raises one of the argument
    errors: an overflowing offset is refused before any read (in C it would be undefined
    behaviour, which ``make test-sanitize`` reports)."""
    with tempfile.TemporaryDirectory() as ns_dir:
        files = BlockFiles(ns_dir, Geometry(64), DIGEST)
        try:
            blocks = [[bytearray(64)] for _ in range(n)]
            try:
                done, status, value = block_io._runread.read_run(
                    files.header_fd, files.data_fd, first, [b"k" * 36] * n, blocks, bytes(digest_len), 1,
                    payload, offset, stride,
                )  # fmt: skip
            except (ValueError, TypeError, OverflowError):
                return
            assert 0 <= done <= n and status in (0, 1, 2, 3, 4)
        finally:
            files.close()


@needs_c
@pytest.mark.parametrize(
    "first, offset, stride", [(2**62, 0, 4096), (0, 2**63 - 4096, 4096), (0, 0, 2**63 - 32)]
)
def test_a_run_past_the_largest_file_offset_is_refused(first, offset, stride):
    """Found by fuzzing: the slot's record offset (``first * 128``) and a block's data
    offset (``offset + i * stride``) were computed in signed 64 bits without a bound, an
    overflow (undefined behaviour) for huge slots; now refused as a bad run."""
    with tempfile.TemporaryDirectory() as ns_dir:
        files = BlockFiles(ns_dir, Geometry(64), DIGEST)
        try:
            with pytest.raises(ValueError, match="bad run"):
                block_io._runread.read_run(
                    files.header_fd, files.data_fd, first, [b"k" * 36] * 2, [[bytearray(64)]] * 2, DIGEST, 1,
                    64, offset, stride,
                )  # fmt: skip
        finally:
            files.close()
