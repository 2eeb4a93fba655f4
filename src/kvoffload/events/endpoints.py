"""ZMQ endpoint strings for the event publisher: validation, defaults, data-parallel offset.

Contract:

* Accepted schemes are ``tcp://HOST:PORT``, ``ipc://PATH`` and ``inproc://NAME``; a bare
  port (``5557`` or ``"5557"``) and ``tcp://:PORT`` mean ``tcp://127.0.0.1:PORT``, so a
  publisher is reachable only from this host unless the caller names another interface
  (``tcp://*:PORT`` for all of them).
* ``for_rank(endpoint, rank)`` gives each data-parallel rank its own endpoint: the tcp
  port is offset by the rank (port 0 stays 0: the OS picks), ``ipc://`` and
  ``inproc://`` endpoints get the suffix ``_dp{rank}``. Rank 0 keeps the endpoint as is.
"""

from __future__ import annotations

from kvoffload.validation import non_negative_int

LOCALHOST = "127.0.0.1"
SCHEMES: tuple[str, ...] = ("tcp", "ipc", "inproc")


def normalize(endpoint: str | int) -> str:
    """``endpoint`` in full ``scheme://address`` form; ``ValueError`` naming it if invalid."""
    if isinstance(endpoint, bool) or not isinstance(endpoint, (str, int)):
        raise ValueError(f"endpoint must be a str or a port number, got {endpoint!r}")
    text = str(endpoint).strip()
    if text.isdigit():
        text = f"tcp://{LOCALHOST}:{text}"
    scheme, sep, address = text.partition("://")
    if not sep or scheme not in SCHEMES or not address:
        raise ValueError(
            f"endpoint must look like tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {endpoint!r}"
        )
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"tcp endpoint needs a port in [0, 65535], got {endpoint!r}")
        return f"tcp://{host or LOCALHOST}:{int(port)}"
    return text


def for_rank(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel ``rank`` derived from the (normalized) ``endpoint``."""
    non_negative_int("data_parallel_rank", rank)
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        if int(port) + rank > 65535:
            raise ValueError(f"tcp port of {endpoint!r} offset by rank {rank} exceeds 65535")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
