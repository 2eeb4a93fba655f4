"""Light installs: the core imports and works without any extra, and each part that needs
one fails with an ``ImportError`` naming it. Each case runs in a fresh interpreter in which
the extra's modules cannot be imported (an import hook refuses them), as on a machine
without them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.extras import EXTRAS, require

SRC = Path(__file__).resolve().parents[2] / "src"

# the core: importable with every extra missing
CORE = [
    "kvoffload", "kvoffload.keys", "kvoffload.manager", "kvoffload.cpu", "kvoffload.policies",
    "kvoffload.scheduler", "kvoffload.events", "kvoffload.events.publisher", "kvoffload.events.subscriber",
    "kvoffload.index", "kvoffload.index.core", "kvoffload.index.service", "kvoffload.sim",
    "kvoffload.sim.fleet", "kvoffload.sim.report", "kvoffload.metrics", "kvoffload.tiers.factory",
    "kvoffload.tiers.fs.tier", "kvoffload.tiers.fs.manager", "kvoffload.tiers.redis.tier",
    "kvoffload.tiers.redis.manager", "kvoffload.tiers.s3.tier", "kvoffload.tiers.s3.manager",
    "kvoffload.cli", "kvoffload.faults", "kvoffload.worker",
]  # fmt: skip

PROBE = """
import importlib, importlib.abc, json, sys
blocked = set(sys.argv[1].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Refuse())
out = {"failed": {}}
for name in sys.argv[2].split(","):
    try:
        importlib.import_module(name)
    except Exception as exc:
        out["failed"][name] = repr(exc)
exec(sys.argv[3], {"out": out})
print(json.dumps(out))
"""


def probe(blocked: list[str], modules: list[str], then: str = "") -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(blocked), ",".join(modules), then],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_core_imports_without_any_extra_and_plans_with_a_disk_tier(tmp_path):
    every = sorted({m for modules in EXTRAS.values() for m in modules})
    # the scheduler side of a CPU + disk configuration runs without torch
    then = f"""
from kvoffload.tiers.factory import TierConfig, build_manager
from kvoffload.tiers.secondary import parse_secondary_tiers
tiers = parse_secondary_tiers([{{"type": "fs", "root_dir": {str(tmp_path)!r}, "bytes_to_use": 1 << 20}}])
m = build_manager(TierConfig(1 << 20, 1, "lru", tiers), 4096, {{"model": "m"}})
out["capacity"] = m.stats().capacity
try:
    from kvoffload.tiers.factory import build_worker
    build_worker(TierConfig(1 << 20), None, 4096)
except ImportError as exc:
    out["worker"] = str(exc)
"""
    out = probe(every, CORE, then)
    assert out["failed"] == {}
    assert out["capacity"] == 256 and "pip install 'kvoffload[torch]'" in out["worker"]


@pytest.mark.parametrize(
    "extra, module, call",
    [
        ("vllm", "kvoffload.integrations.vllm", ""),
        ("sglang", "", "from kvoffload.integrations.sglang import KVOffloadStorage"),
        ("redis", "", "from kvoffload.tiers.redis.client import ServerSettings, connect\n"
                      "connect(ServerSettings('redis://127.0.0.1:1/0'))"),
        ("s3", "", "from kvoffload.tiers.s3.store import S3Settings, ObjectStore\n"
                   "ObjectStore(S3Settings('http://127.0.0.1:1', 'kvb'), 'x')"),
        ("index", "", "from kvoffload.cli import main\nmain(['index', 'serve', '--port', '0'])"),
        ("plot", "", "from kvoffload.sim.report import _draw\n_draw('x.png', 't', 'x', 'y', [], [])"),
    ],
)  # fmt: skip
def test_a_part_whose_extra_is_missing_names_the_extra(extra, module, call):
    then = f"try:\n    exec({call!r})\nexcept ImportError as e:\n    out['error'] = str(e)\n" if call else ""
    out = probe(list(EXTRAS[extra]), [module] if module else [], then)
    message = out["failed"].get(module, "") if module else out.get("error", "")
    assert f"pip install 'kvoffload[{extra}]'" in message, out


def test_require_names_an_unknown_extra():
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        require("os", "gpu", "x")
    assert require("json", "plot", "x") is json
