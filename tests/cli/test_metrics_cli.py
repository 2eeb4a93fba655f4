"""The command-line tools print the counters they expose: ``kvoffload events tail
--metrics-port`` serves its subscriber's counters over HTTP on loopback while it runs and
prints the same lines on exit; a publisher's counters through ``PublisherSource``;
``kvoffload sim --metrics-port`` serves the replayed tier's counters and prints them per row."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest

from free_ports import free_port
from kvoffload import metrics
from kvoffload.cli import main
from kvoffload.events import BlockStored, ZmqEventPublisher

pytestmark = pytest.mark.timeout(120)


def scrape_lines(port: int) -> list[str]:
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            return [line for line in text.splitlines() if line and not line.startswith("#")]
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def stored(i: int) -> BlockStored:
    return BlockStored([i], None, list(range(16)), 16, None, "CPU", None, group_idx=0)


def test_events_tail_serves_and_prints_the_same_counters(tmp_path: Path, capsys) -> None:
    port = free_port()
    with ZmqEventPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", data_parallel_rank=0) as pub:
        source = metrics.PublisherSource(pub)
        for i in range(3):
            pub.publish([stored(i)])
        args = ["events", "tail", f"ipc://{tmp_path}/pub", "--replay", f"ipc://{tmp_path}/replay",
                "--from-start", "--max-batches", "4", "--timeout", "30",
                "--metrics-port", str(port)]  # fmt: skip
        result = {}
        tail = threading.Thread(target=lambda: result.setdefault("code", main(args)))
        tail.start()
        served = []
        while "kvoffload_subscriber_batches_total 3.0" not in served:
            served = scrape_lines(port)  # the tail waits for a fourth batch meanwhile
        pub.publish([stored(3)])
        tail.join(30)
        published = metrics.exposition_lines([source])
    assert result["code"] == 0
    assert "kvoffload_subscriber_batches_lost_total 0.0" in served
    err = capsys.readouterr().err
    assert "batches=4 decoded=4" in err
    printed = [line for line in err.splitlines() if line.startswith("kvoffload_")]
    assert [line.split()[0] for line in printed] == [line.split()[0] for line in served]  # the same names
    assert "kvoffload_subscriber_batches_total 4.0" in printed
    assert "kvoffload_events_published_total 4.0" in published
    assert "kvoffload_events_dropped_total 0.0" in published
    with pytest.raises(OSError):  # the server stopped with the command
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_sim_serves_the_replayed_tier_and_prints_its_counters(tmp_path: Path, capsys) -> None:
    port = free_port()
    served: list[str] = []
    args = ["sim", "chat", "--policies", "lru", "--capacities", "1%,400", "--no-progress",
            "--csv", str(tmp_path / "s.csv"), "--png", str(tmp_path / "s.png"),
            "--metrics-port", str(port)]  # fmt: skip

    def scrape_while_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not served:
            try:
                lines = scrape_lines(port)
            except OSError:
                return
            if any(line.startswith("kvoffload_lookups_total") for line in lines):
                served.extend(lines)

    scraper = threading.Thread(target=scrape_while_running)
    scraper.start()
    assert main(args) == 0
    scraper.join(60)
    out = capsys.readouterr().out
    assert "counters of lru @ 1%, as /metrics serves them:" in out
    assert "counters of lru @ 400, as /metrics serves them:" in out
    section = out.split("counters of lru @ 400, as /metrics serves them:")[1].splitlines()
    printed = {line.split()[0]: float(line.split()[1]) for line in section if line.startswith("  kvoffload_")}
    assert printed['kvoffload_capacity_blocks{tier="0:primary"}'] == 400
    assert (
        printed['kvoffload_lookups_total{tier="0:primary"}']
        > printed['kvoffload_lookup_hits_total{tier="0:primary"}']
        > 0
    )
    assert printed['kvoffload_evictions_total{tier="0:primary"}'] > 0
    with open(tmp_path / "s.csv") as f:
        rows = f.read()
    assert "lru" in rows
    if served:  # the row was caught in flight: the same names
        names = {line.split()[0].split("{")[0] for line in served}
        assert "kvoffload_lookups_total" in names and "kvoffload_blocks" in names


def test_sim_metrics_port_is_refused_with_a_fleet(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--metrics-port"):
        main(["sim", "chat", "--replicas", "2", "--metrics-port", "1", "--no-progress"])


@pytest.mark.parametrize(
    "command", [["sim", "chat", "--no-progress"], ["events", "tail", "tcp://127.0.0.1:1"]]
)
@pytest.mark.parametrize("port", [-1, 65536])
def test_a_port_out_of_range_is_named(tmp_path: Path, command: list[str], port: int) -> None:
    outputs = ["--csv", str(tmp_path / "x.csv"), "--png", str(tmp_path / "x.png")]
    extra = outputs if command[0] == "sim" else []
    with pytest.raises(SystemExit, match=rf"--metrics-port must be a port in 0\.\.65535, got {port}"):
        main([*command, *extra, "--metrics-port", str(port)])
