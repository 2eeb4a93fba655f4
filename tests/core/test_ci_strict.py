"""The suite's CI rule (tests/conftest.py): with ``CI`` set, a skip caused by a dependency
that does not import is a failure; other skips stay skips."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PROBE = """
import pytest

def test_needs_a_missing_module():
    pytest.importorskip("kvoffload_no_such_module")

def test_skips_for_another_reason():
    pytest.skip("the shared trace is not here")
"""


@pytest.fixture
def probe(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((Path(__file__).resolve().parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_probe=PROBE)
    return pytester


def test_with_ci_set_an_import_skip_fails(probe, monkeypatch):
    monkeypatch.setenv("CI", "1")
    result = probe.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["*CI is set and a required dependency does not import*kvoffload_no_such_module*"]
    )


def test_without_ci_both_skip(probe, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    probe.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2)
