"""``kvoffload sim``: outputs and errors naming bad values."""

from __future__ import annotations

import csv

import pytest

from kvoffload.cli import main


def test_writes_table_csv_and_png(tmp_path, capsys):
    out_csv, out_png = tmp_path / "r.csv", tmp_path / "r.png"
    rc = main(
        [
            "sim",
            "documents",
            "--policies",
            "lru,s3fifo,belady",
            "--capacities",
            "1%,0.1,400",
            "--device-blocks",
            "50",
            "--csv",
            str(out_csv),
            "--png",
            str(out_png),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["policy"], r["capacity"]) for r in rows][:3] == [("lru", "1%"), ("lru", "0.1"), ("lru", "400")]
    assert len(rows) == 9 and rows[2]["blocks"] == "400"
    belady = {r["capacity"]: float(r["hit_ratio"]) for r in rows if r["policy"] == "belady"}
    lru = {r["capacity"]: float(r["hit_ratio"]) for r in rows if r["policy"] == "lru"}
    assert all(belady[c] >= lru[c] for c in lru)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "prefill s saved" in printed and "belady" in printed


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--capacities", "2.5"], "'2.5'"),
        (["--capacities", "5%,12parsecs"], "'12parsecs'"),
        (["--policies", "lru,nope"], "'nope'"),
        (["--bandwidth", "fast"], "'fast'"),
        (["--prefill-tps", "-3"], "-3"),
        (["--device-blocks", "-1"], "-1"),
    ],
)
def test_bad_values_are_named(tmp_path, flags, named):
    with pytest.raises(SystemExit) as err:
        main(["sim", "chat", "--csv", str(tmp_path / "x.csv"), "--png", str(tmp_path / "x.png"), *flags])
    assert named in str(err.value)


def test_unknown_source_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no-such-trace.jsonl"):
        main(["sim", str(tmp_path / "no-such-trace.jsonl")])


def test_malformed_trace_names_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 5, "hash_ids": [0]}\n{oops\n')
    with pytest.raises(SystemExit, match="line 2"):
        main(["sim", str(path), "--csv", str(tmp_path / "x.csv"), "--png", str(tmp_path / "x.png")])
