"""Suite-wide rules.

With ``CI`` set, a test or module that would skip because a dependency does not import
(``pytest.importorskip``: vLLM, transformers, safetensors, ...) fails instead: in CI every
extra is installed, so such a skip means a broken install step, not an optional feature.
Skips for other reasons (e.g. the shared trace not beside the checkout) stay skips.

Markers for the real services a test needs (``make test-fast`` leaves them out): a test
is marked ``redis`` when it uses the ``redis_server`` fixture or its module can start a
server itself (it imports ``RedisServer`` or ``RedisCluster``); vLLM tests carry ``vllm``
in their modules, long ones ``slow``.

A ``redis-server`` a test started and left running (it failed before stopping it) is
stopped after the test, by its PID (``redis_server.stop_leftovers``); so are a Mooncake
store's processes (``mooncake_server.stop_leftovers``). Tests that start one carry the
``mooncake`` marker (their module imports ``MooncakeServer`` or they use the
``mooncake_server`` fixture). The same for SeaweedFS's ``weed`` (``s3_server.stop_leftovers``;
marker ``s3``: the module imports ``S3Server`` or a test uses ``s3_server``/``s3_replicas``).

vLLM runs in-process and offline in every test (set here, before any test module imports
it: the engine starts in about 12 s instead of 28 s); ``tiny_llama`` is the tiny random
Llama the engine tests serve, built once per session, and ``reference`` its outputs without
kvoffload, computed for every module in one engine.

An in-process engine starts with the heap frozen (``gc.freeze()`` first, wrapped around
``vllm.LLM``'s constructor when the session runs ``vllm`` tests): vLLM collects the whole
heap three times while it starts (after loading weights, twice, and before it freezes the
heap itself), and a test session's heap of imported modules took about 1 s of that per
engine here. Only what already existed is frozen; the engine's shutdown unfreezes it all
(vLLM's ``cleanup_dist_env_and_memory``), as it would without this.
"""

from __future__ import annotations

import functools
import gc
import os

import pytest

for _name, _value in (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
):
    os.environ.setdefault(_name, _value)

_IMPORT_SKIP = "could not import"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of the default tiny random Llama (``kvoffload.demo.tiny_model``)."""
    from kvoffload.demo.tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="session")
def reference(tiny_llama: str):
    """``reference[text]``: the greedy output of ``tiny_llama`` without kvoffload, every
    prompt named with ``vllm_reference.want`` computed in one engine (``tests/vllm_reference.py``)."""
    from vllm_reference import Reference

    return Reference(tiny_llama)


@pytest.fixture(scope="session", autouse=True)
def _engine_starts_with_the_heap_frozen(request: pytest.FixtureRequest):
    if not any(item.get_closest_marker("vllm") for item in request.session.items):
        yield
        return
    from vllm.entrypoints.llm import LLM

    init = LLM.__init__

    @functools.wraps(init)
    def frozen_first(self, *args, **kwargs):
        gc.freeze()
        init(self, *args, **kwargs)

    LLM.__init__ = frozen_first
    try:
        yield
    finally:
        LLM.__init__ = init


def _strict() -> bool:
    return bool(os.environ.get("CI"))


def _fail_import_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (_strict() and report.skipped and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2])
    if _IMPORT_SKIP in reason:
        report.outcome = "failed"
        report.longrepr = f"CI is set and a required dependency does not import: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail_import_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail_import_skip(outcome.get_result())


@pytest.fixture(autouse=True)
def _no_redis_server_outlives_its_test():
    yield
    from redis_server import stop_leftovers

    stop_leftovers()


@pytest.fixture(autouse=True)
def _no_mooncake_server_outlives_its_test():
    yield
    import sys

    if "mooncake_server" in sys.modules:  # only where a test used it
        sys.modules["mooncake_server"].stop_leftovers()


@pytest.fixture(autouse=True)
def _no_s3_server_outlives_its_test():
    yield
    import sys

    if "s3_server" in sys.modules:  # only where a test used it
        sys.modules["s3_server"].stop_leftovers()


@pytest.fixture
def worker_side():
    """Makes vLLM worker halves (``WorkerSide(...)``) and unregisters each one's metrics
    after the test: a half registers them with kvoffload's process-wide registry, and one
    kept alive (a raised exception's traceback holds its frame) would add its jobs to every
    later scrape."""
    from kvoffload.integrations.vllm.worker_side import WorkerSide

    made = []

    def make(*args):
        made.append(WorkerSide(*args))
        return made[-1]

    yield make
    for side in made:
        side.metrics.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        starts_server = any(hasattr(module, name) for name in ("RedisServer", "RedisCluster"))
        if starts_server or {"redis_server", "replicas"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)
        if hasattr(module, "MooncakeServer") or "mooncake_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.mooncake)
        s3_fixtures = {"s3_server", "s3_replicas"} & set(getattr(item, "fixturenames", ()))
        if hasattr(module, "S3Server") or s3_fixtures:
            item.add_marker(pytest.mark.s3)
