"""kvoffload's connector inside each supported vLLM release's own scheduler.

vLLM's CPU build stops at 0.32 (its engine runs end to end in the other tests); 0.33 and
0.34 are GPU-only releases. ``make test`` installs each (``--no-deps``, over this
environment's torch and dependencies) under ``.venv/vllm-releases/<version>``, and each
case of ``tests/vllm_version_driver.py`` runs in a process of its own with that release
first on the path, plus the installed 0.32: a round trip with the reloaded bytes checked
after the device KV is zeroed (a load a step ahead, and one within the step:
``sync_load_budget_bytes``), preemption and resume, a failed load under ``recompute``,
the in-flight load cap where the release has one, and events in the release's own types.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[3]
RELEASES = ROOT / ".venv" / "vllm-releases"
DRIVER = ROOT / "tests" / "vllm_version_driver.py"
CASES = ("round_trip", "sync_load", "preempt", "failed_load", "inflight_cap", "events")
REQUIRED = ("0.33.0", "0.34.0")  # installed by `make test` (Makefile: vllm-releases)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def releases() -> list[str]:
    found = sorted(p.name for p in RELEASES.glob("*") if (p / "vllm" / "__init__.py").is_file())
    return ["installed", *found]


def release_cache(release: str) -> Path:
    """vLLM's cache folder for a release's driver, beside the installed release's own: vLLM
    caches what it learns of a model class in a file named after the class and checked
    against a hash of its module, which differs between releases. In one folder each
    release replaced the others' entry, and each next engine start, of these drivers or of
    the in-process 0.32 engines after them, re-learnt it in a subprocess importing vLLM
    (about 10 s)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm"
    return Path(os.environ.get("VLLM_CACHE_ROOT", default)).expanduser() / "releases" / release


@pytest.mark.parametrize("release", releases())
def test_connector_in_the_releases_own_scheduler(release, tiny_llama):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(RELEASES / release) if release != "installed" else "", str(ROOT / "src"),
    ]))}  # fmt: skip
    env.pop("LD_PRELOAD", None)  # what an in-process vLLM engine of an earlier test left here
    if release != "installed":
        env["VLLM_CACHE_ROOT"] = str(release_cache(release))
    proc = subprocess.run(
        [sys.executable, str(DRIVER), tiny_llama, *CASES],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
    )
    passed = [line.split() for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert [words[1] for words in passed] == list(CASES)
    if release != "installed":
        assert {words[2] for words in passed} == {release}


def test_the_releases_ci_needs_are_installed():
    if not os.environ.get("CI"):
        pytest.skip("outside CI the releases are optional (make vllm-releases installs them)")
    assert set(REQUIRED) <= set(releases()), f"make vllm-releases did not install {REQUIRED}"


def test_a_release_outside_the_tested_range_is_named_in_a_warning(caplog):
    from kvoffload.integrations.vllm.connector import check_vllm_version

    assert check_vllm_version("0.34.0") and check_vllm_version("0.33.1")
    with caplog.at_level("WARNING", logger="kvoffload.integrations.vllm.connector"):
        assert not check_vllm_version("0.35.0")
    assert "vLLM 0.35.0 is outside the releases" in caplog.text
