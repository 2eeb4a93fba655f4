"""The test helper's promise: a ``redis-server`` a test started is stopped by its PID even
when the test fails before stopping it (``conftest.py`` calls ``stop_leftovers`` after
every test)."""

from __future__ import annotations

from redis_server import RedisServer, stop_leftovers


def test_a_server_left_running_is_stopped_by_its_pid_and_a_stopped_one_is_not_listed(tmp_path):
    (tmp_path / "left").mkdir()
    (tmp_path / "stopped").mkdir()
    left = RedisServer(tmp_path / "left").start()
    stopped = RedisServer(tmp_path / "stopped").start()
    stopped.stop()
    proc = left.proc
    assert proc is not None and proc.poll() is None
    assert stop_leftovers() == [left.port]
    assert proc.poll() is not None, "the server left running was not stopped"
    assert stop_leftovers() == []


def test_a_killed_server_restarted_and_left_running_is_stopped_too(tmp_path):
    server = RedisServer(tmp_path).start()
    server.kill()
    server.start()
    proc = server.proc
    assert stop_leftovers() == [server.port]
    assert proc.poll() is not None
