"""The test helper's promise: a Mooncake store a test started (master, segment holder,
metadata server) is stopped by its PIDs even when the test fails before stopping it
(``conftest.py`` calls ``stop_leftovers`` after every test), and every listener it opens
for the master and the metadata server is on 127.0.0.1."""

from __future__ import annotations

import os
import socket

import pytest

from mooncake_server import MooncakeServer, stop_leftovers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_store_left_running_is_stopped_by_its_pids_and_a_stopped_one_is_not_listed(tmp_path):
    (tmp_path / "left").mkdir()
    (tmp_path / "stopped").mkdir()
    left = MooncakeServer(tmp_path / "left", metadata="http").start()
    stopped = MooncakeServer(tmp_path / "stopped", segment=0).start()
    stopped.stop()
    pids = left.pids()
    assert len(pids) == 3 and all(_alive(pid) for pid in pids)
    assert stop_leftovers() == [left.port]
    assert not any(_alive(pid) for pid in pids), "a process of the store left running was not stopped"
    assert stop_leftovers() == []


def test_a_killed_master_restarted_on_its_port_serves_again_empty(tmp_path):
    server = MooncakeServer(tmp_path).start()
    client = server.client()
    assert client.put("kept?", b"v") == 0 and server.key_count() == 1
    server.restart()  # SIGKILL, then the same port; the holder mounts its segment again
    assert server.capacity() >= server.segment and server.key_count() == 0
    server.stop()


def test_the_master_and_metadata_server_listen_on_loopback_only(tmp_path):
    server = MooncakeServer(tmp_path, metadata="http").start()
    ports = {server.port, server.metrics_port, server.metadata_port}
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.rsplit(":", 1)
                if state == "0A" and int(port, 16) in ports:  # LISTEN
                    listening[int(port, 16)] = address
    server.stop()
    assert set(listening) == ports
    assert all(address == "0100007F" for address in listening.values()), listening  # 127.0.0.1
    assert os.path.exists(tmp_path / "master.log")


def test_a_master_whose_port_is_taken_fails_the_start_naming_its_exit_and_leaves_nothing_running(tmp_path):
    server = MooncakeServer(tmp_path, segment=16 << 20)
    taken = socket.create_server(("127.0.0.1", server.port))  # what a loaded CI run once met
    with taken, pytest.raises(RuntimeError, match=r"mooncake_master exited with \d+"):
        server.start()
    assert server.pids() == [] and stop_leftovers() == []
