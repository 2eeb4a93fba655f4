"""Import weight: the scheduler-side layers are pure bookkeeping and must not load the
worker's or the event transport's heavy dependencies (torch, pyzmq)."""

from __future__ import annotations

import pytest

from import_probe import imported_top_level_modules

HEAVY = ("torch", "zmq")


@pytest.mark.parametrize(
    "code",
    [
        "import kvoffload.scheduler; kvoffload.scheduler.OffloadingScheduler; kvoffload.scheduler.KVGroup",
        "import kvoffload.cpu, kvoffload.specs, kvoffload.worker, kvoffload.policies",
        "from kvoffload.tiers.factory import TierConfig, build_manager",
        "from kvoffload.events.types import BlockStored; from kvoffload.events.codec import encode",
    ],
)
def test_scheduler_side_imports_load_neither_torch_nor_zmq(code):
    loaded = imported_top_level_modules(code)
    assert "kvoffload" in loaded  # the probe sees our own imports
    assert not loaded & set(HEAVY), f"{code!r} loaded {sorted(loaded & set(HEAVY))}"


def test_the_probe_sees_torch_when_the_worker_side_is_imported():
    assert "torch" in imported_top_level_modules(
        "import kvoffload.transfer; kvoffload.transfer.TransferEngine"
    )
