"""scripts/cuda_transfer_check.py runs from the repository alone: it (and every kvoffload
module it pulls in) imports nothing but torch, numpy and the standard library, and on a
machine without CUDA it prints one JSON line saying it skipped, and exits 0."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cuda_transfer_check.py"
SRC = ROOT / "src"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_imports_only_torch_numpy_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "kvoffload"}
    seen: set[Path] = set()
    todo = [SCRIPT]
    outside: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in allowed:
                outside.add(f"{name} (in {path.relative_to(ROOT)})")
            if top == "kvoffload" and (module := _module_file(name)) is not None:
                todo.append(module)
                # a package's __init__ runs too
                parts = name.split(".")
                for i in range(1, len(parts)):
                    if (parent := _module_file(".".join(parts[:i]))) is not None:
                        todo.append(parent)
    # The transfer package re-exports lazily: what it names must be allowed as well.
    lazy = _module_file("kvoffload.transfer")
    assert lazy is not None and lazy in seen
    assert not outside, sorted(outside)
    assert len(seen) > 5  # it really followed kvoffload's own imports


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the whole check")
def test_without_cuda_it_skips_with_one_json_line():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1
    assert "skipped" in json.loads(lines[0])
