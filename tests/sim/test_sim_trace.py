"""Mooncake-format trace reading and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.sim.trace import TraceFormatError, read_trace

SHARED = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl"
)


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_requests_and_block_size(tmp_path):
    path = write(
        tmp_path,
        '{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n'
        "\n"
        '{"timestamp": 3, "input_length": 300, "output_length": 1, "hash_ids": [0]}\n',
    )
    trace = read_trace(path, block_size=512)
    assert [r.hash_ids for r in trace.requests] == [(0, 1), (0,)]
    assert trace.requests[1].timestamp == 3 and trace.requests[0].output_length == 5
    assert trace.block_size == 512 and trace.unique_blocks() == 2 and trace.block_references() == 3


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected an object"),
        ('{"input_length": -1, "hash_ids": []}', "input_length"),
        ('{"input_length": 5, "hash_ids": [1, "x"]}', "hash_ids"),
        ('{"input_length": 5}', "hash_ids"),
        ('{"input_length": true, "hash_ids": [1]}', "input_length"),
    ],
)
def test_malformed_line_names_its_number(tmp_path, bad, fragment):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    path = write(tmp_path, f"{good}\n\n{bad}\n{good}\n")
    with pytest.raises(TraceFormatError, match=rf"line 3: .*{fragment}"):
        read_trace(path)


def test_bad_block_size_is_named(tmp_path):
    with pytest.raises(ValueError, match="block_size.*0"):
        read_trace(write(tmp_path, ""), block_size=0)


@pytest.mark.skipif(not SHARED.exists(), reason="shared Mooncake trace not present")
def test_conversation_trace_counts():
    trace = read_trace(SHARED)
    assert len(trace.requests) == 12031
    assert trace.unique_blocks() == 182790
    assert trace.block_references() == 288500
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in trace.requests)
