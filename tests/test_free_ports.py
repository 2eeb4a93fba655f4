"""The test servers' port picker: ports below the kernel's ephemeral range (which no
outgoing connection or ``bind(0)`` takes), never handed out twice by one process, never one
something listens on."""

from __future__ import annotations

import socket

import pytest

import free_ports
from free_ports import BUS_OFFSET, HIGH, LOW, free_port


def test_picks_are_distinct_and_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_start = int(f.read().split()[0])
    picks = [free_port() for _ in range(300)] + [free_port(with_bus=True) for _ in range(50)]
    assert len(set(picks)) == len(picks)
    assert all(LOW <= port < ephemeral_start for port in picks)
    assert all(port + BUS_OFFSET < ephemeral_start for port in picks[300:])


def _listen(port: int) -> socket.socket:
    return socket.create_server(("127.0.0.1", port))


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    busy, idle = HIGH - 2, HIGH - 1
    monkeypatch.setattr(free_ports, "_given", set(range(LOW, HIGH)) - {busy, idle})
    with _listen(busy):
        assert free_port() == idle
        with pytest.raises(RuntimeError, match=f"no free loopback port left in {LOW}..{HIGH - 1}"):
            free_port()  # idle is handed out now, busy still listens


def test_a_cluster_port_needs_its_bus_port_free(monkeypatch):
    blocked, good = LOW, LOW + 1  # blocked's bus port is listened on
    monkeypatch.setattr(free_ports, "_given", set(range(LOW, HIGH)) - {blocked, good, good + BUS_OFFSET})
    with _listen(blocked + BUS_OFFSET):
        assert free_port(with_bus=True) == good
