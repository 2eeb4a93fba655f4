"""Loopback ports for the servers tests start, chosen where nothing else takes them.

A port found free and handed to a child process is only reserved once the child binds it.
A port from the kernel's ephemeral range (``bind(0)``) can be taken in between by any
outgoing connection or ``bind(0)`` on the machine; a loaded CI run saw exactly that (a
``mooncake_master`` whose RPC port was taken exits silently). So ``free_port()`` picks
from ``LOW`` up to the ephemeral range's start, which the kernel never hands out by itself,
above the ports Mooncake's transfer engine picks at random (12300 to about 17000). A port
is handed out at most once per process (so the ports a server picks before it starts are
distinct), and is checked free (bound and closed) when picked.
"""

from __future__ import annotations

import random
import socket

LOW = 20000
BUS_OFFSET = 10000  # a Redis Cluster node's bus port is its port + 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


HIGH = _ephemeral_start()  # exclusive
if HIGH - BUS_OFFSET - LOW < 1000:
    raise RuntimeError(f"the ephemeral port range starts at {HIGH}: too low for test ports from {LOW}")

_given: set[int] = set()  # ports (bus ports included) this process handed out
_rng = random.Random()


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(with_bus: bool = False) -> int:
    """A free loopback port below the ephemeral range, not handed out before by this
    process; ``with_bus``: port + 10000 is free too (a cluster node's bus port)."""
    top = HIGH - (BUS_OFFSET if with_bus else 0)
    candidates = [p for p in range(LOW, top) if p not in _given]
    _rng.shuffle(candidates)
    for port in candidates:
        ports = (port, port + BUS_OFFSET) if with_bus else (port,)
        if any(p in _given for p in ports) or not all(_is_free(p) for p in ports):
            continue
        _given.update(ports)
        return port
    raise RuntimeError(f"no free loopback port left in {LOW}..{HIGH - 1}")
