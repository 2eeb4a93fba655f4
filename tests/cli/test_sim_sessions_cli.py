"""``kvoffload sim`` with session hints and a flood: the table, the CSV, and errors naming
bad values."""

from __future__ import annotations

import csv
import json

import pytest

from kvoffload.cli import main


@pytest.fixture
def session_trace(tmp_path):
    """aiperf-style sessions: a turn, one-off requests filling a 16-block tier, the next turn."""
    lines = [{"session_id": "s", "timestamp": 0, "input_length": 4 * 512 + 100, "hash_ids": [1, 2, 3, 4, 90]}]
    for k in range(4):
        ids = [100 + 10 * k + j for j in range(4)] + [200 + k]
        lines.append({"timestamp": 1000 + k, "input_length": 4 * 512 + 100, "hash_ids": ids})
    lines.append(
        {"session_id": "s", "delay": 10_000, "input_length": 6 * 512 + 1, "hash_ids": [1, 2, 3, 4, 5, 6, 91]}
    )
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(tmp_path, *flags) -> int:
    return main(
        ["sim", *flags, "--csv", str(tmp_path / "s.csv"), "--png", str(tmp_path / "s.png"), "--no-progress"]
    )


def test_retain_hints_table_and_csv(tmp_path, capsys, session_trace):
    rc = run(tmp_path, str(session_trace), "--hints", "retain", "--retain-ttl-s", "60", "--policies",
             "lru,belady", "--capacities", "16")  # fmt: skip
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert [(r["policy"], r["capacity"], r["hints"]) for r in rows] == [
        ("lru", "16", "none"),
        ("lru", "16", "retain"),
    ]
    none, retain = rows
    assert float(none["resumed_hit_ratio"]) == 0.0
    assert float(retain["resumed_hit_ratio"]) == pytest.approx(4 / 7)
    assert int(retain["retained"]) == 4 and none["resumed_requests"] == "1"
    printed = capsys.readouterr().out
    assert "belady left out" in printed and "resumed" in printed and "blocks for 60 s" in printed
    assert not (tmp_path / "s.png").exists()


def test_flood_on_a_builtin_workload_counts_only_the_trace(tmp_path, capsys):
    rc = run(tmp_path, "agentic", "--hints", "none", "--flood-size", "2%", "--policies", "lru",
             "--capacities", "1%")  # fmt: skip
    assert rc == 0
    (row,) = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert row["hints"] == "none" and int(row["requests"]) == 1883 and int(row["resumed_requests"]) == 1683
    assert "one-off blocks every" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--retain-ttl-s", "30"], "--retain-ttl-s 30.0 needs --hints retain"),
        (["--hints", "none", "--retention-fraction", "0.3"], "--retention-fraction 0.3 needs --hints retain"),
        (
            ["--hints", "retain", "--retention-fraction", "2"],
            "--retention-fraction must be in [0, 1], got 2.0",
        ),
        (["--hints", "retain", "--retain-ttl-s", "-1"], "--retain-ttl-s must be positive seconds, got -1.0"),
        (["--flood-every-s", "0"], "--flood-every-s must be positive seconds, got 0.0"),
        (["--flood-size", "lots"], "'lots'"),
        (["--hints", "retain", "--replicas", "2"], "--replicas 2"),
        (["--hints", "retain", "--disk-capacities", "10%"], "--disk-capacities '10%'"),
        (["--hints", "retain", "--policies", "belady"], "belady has no session replay"),
    ],
)
def test_bad_session_options_are_named(tmp_path, session_trace, flags, named):
    with pytest.raises(SystemExit) as err:
        run(tmp_path, str(session_trace), *flags)
    assert named in str(err.value)


def test_unknown_hints_are_refused(tmp_path, capsys, session_trace):
    with pytest.raises(SystemExit):
        run(tmp_path, str(session_trace), "--hints", "prefetch")
    assert "'prefetch'" in capsys.readouterr().err


def test_retain_ttl_defaults_to_the_traces_90th_percentile_pause(tmp_path, capsys, session_trace):
    assert (
        run(tmp_path, str(session_trace), "--hints", "retain", "--policies", "lru", "--capacities", "16") == 0
    )
    assert "blocks for 10 s" in capsys.readouterr().out
    (_, retain) = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert float(retain["resumed_hit_ratio"]) == pytest.approx(4 / 7)
