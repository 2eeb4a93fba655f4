"""What a piece of code imports: ``imported_top_level_modules(code)`` runs it in a fresh
interpreter and returns the top-level modules Python reports loading."""

from __future__ import annotations

import subprocess
import sys


def imported_top_level_modules(code: str) -> set[str]:
    """Top-level module names Python reports loading (``-X importtime``) while running ``code``."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True
    )
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names
