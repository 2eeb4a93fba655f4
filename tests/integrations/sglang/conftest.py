"""Tests on a real SGLang 0.5.23 (its engine, host pools and storage interfaces).

They run in the SGLang environment (``.venv/sglang``, ``make sglang-env``; ``make test``
runs this folder there after the main suite). SGLang pins transformers 5.19, which the
main environment's vLLM does not take, so in the main environment (where ``sglang`` does
not import) this folder collects nothing: its files are ignored here rather than skipped
with ``importorskip``, which the top-level conftest turns into failures when ``CI`` is set.

In the SGLang environment, before any test module imports SGLang:

- ``SGLANG_USE_CPU_ENGINE=1`` (SGLang reads it once per process: its CPU engine, which
  the engine tests need; see ``engine.py``);
- ``standins/`` goes first on ``sys.path``: the ``torchvision`` and ``sgl_kernel``
  stand-in packages (each one's docstring says what it stands in for and why);
- the stand-ins for HiCache's CUDA-only parts (``engine_standins``) are installed in this
  process, so tests that build SGLang's host pools here see what the engine's processes
  see.

Every test here carries the ``sglang`` marker.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent

if importlib.util.find_spec("sglang") is None:
    # the main environment: nothing here can run (see the docstring)
    collect_ignore_glob = ["*"]
else:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    for _folder in (_HERE, _HERE / "standins"):
        if str(_folder) not in sys.path:
            sys.path.insert(0, str(_folder))
    import engine_standins

    engine_standins.install()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.sglang)
