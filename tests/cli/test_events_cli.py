"""``kvoffload events tail`` against a real publisher, in-process and as a subprocess."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.cli.events import REPLAY_TIMEOUT_S
from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored, ZmqEventPublisher

pytestmark = pytest.mark.timeout(60)


def test_tail_prints_one_line_per_event_and_counters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ZmqEventPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", data_parallel_rank=0) as pub:
        pub.publish([BlockStored([2**64 - 1, 5], 7, list(range(32)), 16, None, "CPU", None, group_idx=0)])
        pub.publish([BlockRemoved([5], "CPU", group_idx=0), AllBlocksCleared()])
        code = main(
            ["events", "tail", f"ipc://{tmp_path}/pub", "--replay", f"ipc://{tmp_path}/replay",
             "--from-start", "--max-batches", "2", "--timeout", "20"]
        )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 3
    assert (
        lines[0].startswith("seq=0 ")
        and "BlockStored medium=CPU group=0 blocks=2 block_size=16 tokens=32" in lines[0]
    )
    assert "parent=0000000000000007" in lines[0] and "hashes=ffffffffffffffff,0000000000000005" in lines[0]
    assert lines[1].startswith("seq=1 ") and "BlockRemoved medium=CPU group=0 blocks=1" in lines[1]
    assert lines[2].startswith("seq=1 ") and lines[2].endswith("AllBlocksCleared")
    assert "batches=2 decoded=2" in err and "lost=0" in err and "malformed=0" in err


def test_tail_timeout_exits_cleanly_without_a_publisher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["events", "tail", f"ipc://{tmp_path}/none", "--timeout", "0.3"]) == 0
    assert "batches=0 decoded=0" in capsys.readouterr().err


def test_tail_rejects_a_bad_endpoint_naming_it() -> None:
    with pytest.raises(SystemExit, match="'udp://x:1'"):
        main(["events", "tail", "udp://x:1"])


@pytest.mark.parametrize("replay", [False, True])
def test_tail_exits_with_its_counters_promptly_after_ctrl_c_beside_a_cpu_hog(tmp_path: Path, replay) -> None:
    """One busy loop per core runs while the tail starts, prints and is interrupted; with
    ``--replay`` its idle catch-ups ask a replay endpoint nobody answers. By design Ctrl-C
    ends the tail within one receive (0.2 s) and one replay wait (``REPLAY_TIMEOUT_S``);
    the bound adds 4 s for the hogs and a loaded machine (the old 2 s bound failed beside
    other work)."""
    endpoint = f"ipc://{tmp_path}/pub"
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    extra = ["--replay", f"ipc://{tmp_path}/nobody"] if replay else []
    try:
        with ZmqEventPublisher(endpoint) as pub:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvoffload.cli", "events", "tail", endpoint, *extra],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            try:
                assert proc.stdout is not None
                deadline = time.monotonic() + 40
                line = ""
                while "BlockRemoved" not in line and time.monotonic() < deadline:
                    pub.publish([BlockRemoved([1], "CPU")])
                    if select.select([proc.stdout], [], [], 0.2)[0]:
                        line = proc.stdout.readline()
                assert "BlockRemoved medium=CPU" in line
                time.sleep(1.5 if replay else 0.1)  # into an idle catch-up
                proc.send_signal(signal.SIGINT)
                start = time.monotonic()
                proc.wait(30)  # a hang guard
                seconds = time.monotonic() - start
                _, err = proc.communicate(timeout=10)
            finally:
                proc.kill()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert proc.returncode == 130
    assert "batches=" in err and "decoded=" in err and "lost=" in err
    assert seconds < REPLAY_TIMEOUT_S + 0.2 + 4.0, seconds
