"""The test helper's promises: a ``weed mini`` a test started is stopped by its PID even
when the test fails before stopping it (``conftest.py`` calls ``stop_leftovers`` after
every test), every socket it listens on is bound to 127.0.0.1, anonymous requests are
refused, a SIGKILLed server restarted on its folder serves what it acknowledged, and
``freeze()`` returns only once the server is stopped."""

from __future__ import annotations

import glob
import os
import urllib.error
import urllib.request

import obstore
import pytest

from s3_server import S3Server, stop_leftovers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_left_running_is_stopped_by_its_pid_and_a_stopped_one_is_not_listed(tmp_path):
    (tmp_path / "left").mkdir()
    (tmp_path / "stopped").mkdir()
    left = S3Server(tmp_path / "left").start()
    stopped = S3Server(tmp_path / "stopped").start()
    stopped.stop()
    pid = left.pid()
    key_env, _ = left.env_names()
    assert pid is not None and _alive(pid) and key_env in os.environ
    assert stop_leftovers() == [left.ports["s3"]]
    assert not _alive(pid), "the server left running was not stopped"
    assert key_env not in os.environ  # its credentials left the environment with it
    assert not [p for port in left.ports.values() for p in glob.glob(f"/tmp/seaweedfs-*-{port}.sock")]
    assert stop_leftovers() == []


def test_every_listener_is_on_loopback_and_anonymous_requests_are_refused(s3_server):
    listening = s3_server.listeners()
    assert {port for _, port in listening} == set(s3_server.ports.values()), listening
    assert {address for address, _ in listening} == {"127.0.0.1"}, listening
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{s3_server.endpoint}/{s3_server.bucket}/?list-type=2", timeout=5)
    assert refused.value.code == 403


def test_a_killed_server_restarted_on_its_folder_serves_what_it_acknowledged(tmp_path):
    server = S3Server(tmp_path).start()
    client = server.client()
    for i in range(20):
        obstore.put(client, f"kept/{i}", bytes([i]) * 1000)
    server.restart()  # SIGKILL, then the same ports and folder
    assert server.names("kept") == sorted(f"kept/{i}" for i in range(20))
    for i in range(20):
        assert bytes(obstore.get(server.client(), f"kept/{i}").bytes()) == bytes([i]) * 1000
    server.stop()


def test_freeze_returns_only_once_every_thread_is_stopped_and_thaw_once_none_is(s3_server):
    """``kill(SIGSTOP)`` returns before the threads stop (each stops when it next runs):
    a test that sent a request right after it was answered by the "frozen" server. So
    ``freeze()`` waits for every thread, checked here at once, over many cycles."""
    for _ in range(30):
        s3_server.freeze()
        states = s3_server.thread_states()
        assert len(states) > 1 and set(states) == {"T"}, states
        s3_server.thaw()
        assert "T" not in s3_server.thread_states()
    obstore.put(s3_server.client(), "after-thaw", b"x" * 100)  # it serves again
    assert bytes(obstore.get(s3_server.client(), "after-thaw").bytes()) == b"x" * 100
