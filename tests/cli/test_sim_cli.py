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


def test_plot_ticks_are_the_capacities_as_typed(tmp_path, monkeypatch):
    import kvoffload.cli.sim as cli

    drawn = []
    real = cli.write_plot
    monkeypatch.setattr(cli, "write_plot", lambda *a, **k: drawn.append(real(*a, **k)))
    rc = main(
        ["sim", "chat", "--policies", "lru", "--capacities", "64GiB,1%,500MB,200",
         "--csv", str(tmp_path / "x.csv"), "--png", str(tmp_path / "x.png"), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    # chat blocks are 256 tokens x 128 KiB = 32 MiB: 500MB = 14 blocks, 1% = 53, 64GiB = 2048
    assert drawn == [["500MB", "1%", "200", "64GiB"]]


def test_disk_tier_table_csv_and_plot(tmp_path, capsys, monkeypatch):
    import kvoffload.cli.sim as cli

    drawn = []
    real = cli.write_disk_plot
    monkeypatch.setattr(cli, "write_disk_plot", lambda *a, **k: drawn.append(real(*a, **k)))
    out_csv, out_png = tmp_path / "d.csv", tmp_path / "d.png"
    rc = main(
        ["sim", "chat", "--policies", "lru,belady", "--capacities", "1%,5%",
         "--disk-capacities", "25%,8GiB", "--disk-bandwidth", "2GB",
         "--csv", str(out_csv), "--png", str(out_png), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "belady left out" in printed and "disk reads 2.0 GB/s" in printed
    header = next(line for line in printed.splitlines() if line.startswith("policy"))
    assert header.split()[:7] == ["policy", "cpu", "disk", "device", "cpu", "disk", "total"]
    assert "cpu GB r/w" in header and "disk GB r/w" in header
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["policy"], r["capacity"], r["disk_capacity"]) for r in rows] == [
        ("lru", "1%", "25%"),
        ("lru", "1%", "8GiB"),
        ("lru", "5%", "25%"),
        ("lru", "5%", "8GiB"),
    ]
    assert [r["disk_blocks"] for r in rows[:2]] == ["1330", "256"]  # 8GiB / 32 MiB blocks
    for r in rows:
        parts = sum(float(r[f"{tier}_hit_ratio"]) for tier in ("device", "cpu", "disk"))
        assert abs(parts - float(r["hit_ratio"])) < 1e-5  # the CSV keeps 6 significant digits
        assert int(r["disk_bytes_written"]) > 0 and r["admit"] == "all"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == [["8GiB", "25%"]]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--disk-capacities", "10%,lots"], "--disk-capacities: bad capacity 'lots'"),
        (["--disk-capacities", "150%"], "'150%'"),
        (["--disk-capacities", " , "], "--disk-capacities is empty"),
        (["--disk-capacities", "10%", "--disk-bandwidth", "fast"], "--disk-bandwidth: not a size: 'fast'"),
        (["--disk-capacities", "10%", "--disk-policy", "nope"], "'nope'"),
        (["--disk-policy", "lru"], "--disk-policy 'lru' needs --disk-capacities"),
        (["--disk-admit", "seen-twice"], "--disk-admit 'seen-twice' needs --disk-capacities"),
        (["--disk-capacities", "10%", "--policies", "belady"], "--policies 'belady'"),
    ],
)
def test_bad_disk_values_are_named(tmp_path, flags, named):
    with pytest.raises(SystemExit) as err:
        main(["sim", "chat", "--csv", str(tmp_path / "x.csv"), "--png", str(tmp_path / "x.png"), *flags])
    assert named in str(err.value)


def test_capacity_ticks_join_capacities_typed_for_the_same_size():
    from kvoffload.sim.report import capacity_ticks

    ticks = capacity_ticks([(500, "5%"), (100, "1%"), (500, "0.05"), (500, "5%"), (2048, "64GiB")])
    assert ticks == ([100, 500, 2048], ["1%", "5% / 0.05", "64GiB"])
