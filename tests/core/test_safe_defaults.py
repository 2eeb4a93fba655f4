"""Safe defaults (issue 14, item 5), on real sockets, real files and a real redis-server:

* every socket kvoffload listens on is bound to 127.0.0.1 unless configured otherwise;
* no pickle anywhere in the package (nothing that could unpickle from a wire or a file);
* the disk tier's folders are 0700 and its files 0600 whatever the umask;
* a Redis password never appears in a log line or an error.
"""

from __future__ import annotations

import ast
import logging
import os
import socket
import stat
import subprocess
import sys
import time
import traceback
from pathlib import Path

import psutil
import pytest

from free_ports import free_port
from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.index import BlockIndex, IndexServer, IndexService, TierWeights
from kvoffload.metrics import serve as serve_metrics
from kvoffload.tiers.fs.format import DATA_FILE, HEADER_FILE, INFO_FILE, LOCK_FILE
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from redis_server import RedisServer

SRC = Path(__file__).resolve().parents[2] / "src" / "kvoffload"
pytestmark = pytest.mark.timeout(120)


# -- sockets ------------------------------------------------------------------------------


def listening(pid: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of a process."""
    conns = psutil.Process(pid).net_connections(kind="inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def other_addresses() -> list[str]:
    """This host's IPv4 addresses that are not loopback."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def reachable(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def test_every_listening_socket_is_on_loopback_by_default():
    before = listening()
    publishers = [
        ZmqEventPublisher(0, replay_endpoint=0),  # bare ports
        ZmqEventPublisher("0", replay_endpoint="tcp://:0"),  # and a host left out
    ]
    index = IndexServer(IndexService(BlockIndex(TierWeights()))).start()
    metrics = serve_metrics(0)
    try:
        ours = listening() - before
        assert len(ours) == 6  # 2 PUB + 2 replay ROUTER + index HTTP + metrics HTTP
        assert {address for address, _ in ours} == {"127.0.0.1"}
        for address in other_addresses():  # and nothing answers on the other interfaces
            assert not any(reachable(address, port) for _, port in ours)
        assert all(reachable("127.0.0.1", port) for _, port in ours)

        # configured otherwise, it binds what it is told: the check above would see it
        wide = ZmqEventPublisher("tcp://*:0")
        try:
            (new,) = listening() - before - ours
            assert new[0] == "0.0.0.0"
        finally:
            wide.close()
    finally:
        metrics.shutdown()
        metrics.server_close()
        index.stop()
        for p in publishers:
            p.close()


def test_the_index_command_binds_loopback_by_default():
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "index", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving on http://127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])
        assert listening(proc.pid) == {("127.0.0.1", port)}
    finally:
        proc.terminate()
        proc.wait(30)


# -- no pickle ----------------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal", "joblib"}
UNSAFE_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "load"}  # load: torch.load, np.load


def unsafe_uses(source: str) -> list[str]:
    """Imports of pickle-like modules and calls that unpickle (``x.recv_pyobj()``,
    ``torch.load``, ``numpy.load`` without ``allow_pickle=False``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else ""
            if name in ("recv_pyobj", "send_pyobj", "recv_serialized"):
                found.append(name)
            elif name == "load" and owner_name in ("torch", "np", "numpy"):
                safe = any(
                    k.arg in ("allow_pickle", "weights_only") and getattr(k.value, "value", None) is not True
                    for k in node.keywords
                )
                if owner_name == "torch" or not safe:
                    found.append(f"{owner_name}.load")
    return found


def test_the_detector_finds_what_it_looks_for():
    assert unsafe_uses("import pickle") == ["pickle"]
    assert unsafe_uses("from cloudpickle import loads") == ["cloudpickle"]
    assert unsafe_uses("sock.recv_pyobj()") == ["recv_pyobj"]
    assert unsafe_uses("torch.load(f)") == ["torch.load"]
    assert unsafe_uses("np.load(f)") == ["np.load"]
    assert unsafe_uses("np.load(f, allow_pickle=False)") == []
    assert unsafe_uses("import json, msgspec") == []


def test_no_pickle_in_the_package():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50
    found = {str(f.relative_to(SRC)): uses for f in files if (uses := unsafe_uses(f.read_text()))}
    assert found == {}


# -- private files --------------------------------------------------------------------------


def modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return out


def start_fs_tier(root_dir: Path):
    """Both halves of a disk tier, built from configuration as an engine builds them."""
    from transfer_oracle import make_pool, pool_block_bytes

    (tier,) = parse_secondary_tiers([{"type": "fs", "root_dir": str(root_dir), "bytes_to_use": 1 << 20}])
    pool = make_pool()
    context = TierContext(pool_block_bytes(pool), {"model": "safe-defaults"})
    manager = tier.build_manager(context, "lru")
    worker = tier.build_worker(context, pool)
    return manager, worker


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_disk_tier_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        manager, worker = start_fs_tier(tmp_path / "made" / "by" / "kvoffload")
        worker.close()
        manager.close()
    finally:
        os.umask(old)
    found = modes(tmp_path / "made")
    (namespace,) = [p for p in found if p.count("/") == 2]
    files = {f"{namespace}/{name}" for name in (DATA_FILE, HEADER_FILE, LOCK_FILE, INFO_FILE)}
    assert set(found) == {"by", "by/kvoffload", namespace} | files
    assert {p: m for p, m in found.items() if p not in files} == dict.fromkeys(
        ["by", "by/kvoffload", namespace], 0o700
    )
    assert {p: found[p] for p in files} == dict.fromkeys(files, 0o600)
    assert stat.S_IMODE((tmp_path / "made").stat().st_mode) == 0o700


def test_what_an_earlier_run_left_open_is_made_private_but_the_operators_root_is_kept(tmp_path):
    root = tmp_path / "kv"
    manager, worker = start_fs_tier(root)
    worker.close()
    manager.close()
    root.chmod(0o755)  # the operator's folder, shared on purpose
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    manager, worker = start_fs_tier(root)
    worker.close()
    manager.close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert set(modes(root).values()) == {0o700, 0o600}


def test_an_ipc_event_socket_file_is_0600(tmp_path):
    old = os.umask(0)
    try:
        publisher = ZmqEventPublisher(f"ipc://{tmp_path}/events", replay_endpoint=f"ipc://{tmp_path}/replay")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE((tmp_path / "events").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "replay").stat().st_mode) == 0o600
    finally:
        publisher.close()


# -- secrets --------------------------------------------------------------------------------

SECRET = "Xq7-s3cr3t-Zr9w"


def shown(exc: BaseException) -> str:
    """Everything an exception can show: its text, its repr, the traceback a logger would
    print, and the text of what it was raised from or during."""
    parts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    if exc.__cause__ is not None or exc.__context__ is not None:
        parts += [repr(exc.__cause__), repr(exc.__context__), str(exc.__context__)]
    return "\n".join(parts)


def logged(caplog) -> str:
    lines = [caplog.text]
    for record in caplog.records:
        lines.append(record.getMessage())
        if record.exc_info:
            lines.append("".join(traceback.format_exception(*record.exc_info)))
    return "\n".join(lines)


def redis_replica(url: str):
    from redis_replica import Replica

    return Replica(url, probe_timeout_s=0.5, reconcile_interval_s=0.2)


def test_a_password_in_the_url_never_reaches_logs_or_errors(tmp_path, caplog):
    from kvoffload.keys import make_offload_key

    caplog.set_level(logging.DEBUG)
    key = make_offload_key(bytes(32), 0)
    texts = []

    # nothing listens: a degraded start, lookups that miss, stores that fail
    replica = redis_replica(f"redis://app:{SECRET}@127.0.0.1:{free_port()}/0")
    try:
        replica.settle(key)
        result = replica.store([key], [0])
        assert not result.success
        texts += [repr(result), repr(replica.worker.counters()), repr(replica.tier.server)]
        time.sleep(0.5)  # the breakers retry and log
    finally:
        replica.close()
    assert "unreachable at start-up" in caplog.text and "server unavailable" in caplog.text

    # a real server that refuses the password
    server = RedisServer(tmp_path).start(extra=("--requirepass", "the-right-one"))
    try:
        with pytest.raises(ValueError, match="rejected the credentials") as info:
            redis_replica(f"redis://:{SECRET}@127.0.0.1:{server.port}/0")
        texts.append(shown(info.value))
    finally:
        server.stop()

    # malformed URLs: a password with reserved characters is split elsewhere by a parser
    for url in (
        f"redis://:{SECRET}#x@host:6379/0",
        f"redis://:{SECRET}/x@host:6379",
        f"redis://:{SECRET}@h:port/0",
    ):
        with pytest.raises(ValueError) as info:
            parse_secondary_tiers([{"type": "redis", "url": url}])
        texts.append(shown(info.value))

    everything = "\n".join(texts) + logged(caplog)
    assert "***" in everything
    for fragment in (SECRET, *SECRET.split("-")):
        assert fragment not in everything, fragment


def test_a_password_from_the_environment_never_reaches_logs_or_errors(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KV_REDIS_PASSWORD", SECRET)
    server = RedisServer(tmp_path).start(extra=("--requirepass", "the-right-one"))
    try:
        with pytest.raises(ValueError, match="rejected the credentials") as info:
            parse_secondary_tiers(
                [
                    {
                        "type": "redis",
                        "url": f"redis://127.0.0.1:{server.port}/0",
                        "password_env": "KV_REDIS_PASSWORD",
                    }
                ]
            )[0].build_manager(TierContext(4096, {"model": "x"}), "lru")
    finally:
        server.stop()
    assert SECRET not in shown(info.value) + logged(caplog)


@pytest.mark.parametrize(
    "text",
    [
        f"redis://user:{SECRET}@host:6379/0",
        f"rediss://:{SECRET}@[::1]:6379/0",
        f"redis://:{SECRET}#x@host:6379/0",  # unescaped: a parser takes '#...' for a fragment
        f"redis://:{SECRET}@x@host:6379/0",
        f"redis://{SECRET}@host:6379/0",  # no ':': the user part may be a password too
        f"redis://host:6379/0?db=1&password={SECRET}",
        f"Error connecting to redis://:{SECRET}@host:6379/0: refused",  # a URL inside text
    ],
)
def test_redact_hides_the_password_of_any_url_shape(text):
    from kvoffload.tiers.redis.client import redact

    out = redact(text)
    assert "***" in out
    assert not any(fragment in out for fragment in (SECRET, *SECRET.split("-"))), out
    assert "host" in out or "::1" in out  # where it points stays readable
