"""A real SGLang 0.5.23 engine with HiCache and a storage backend, on this CPU, for tests.

``start_engine(model_path, storage_backend=..., extra_config=...)`` starts
``sglang.Engine`` (SGLang's offline engine: a tokenizer manager in the test process, a
scheduler per TP rank and a detokenizer in child processes) with the hierarchical cache
on (device pool -> host pool -> storage backend) and returns a ``RunningEngine``:
``generate(prompt)`` (greedy; the output and ``meta_info["cached_tokens_details"]`` as a
``Generation``), ``flush_cache()`` (empties the device and host caches; storage keeps its
pages), ``shutdown()`` (stops the engine and, by PID, any process it left behind).
A start takes 13-20 s here on an idle machine (TP=2 about 18 s), up to a minute under load.

How SGLang runs on CPU here:

- ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU engine (``is_cpu()``): torch-native
  attention and layers where no Intel AMX is present. Without it SGLang takes its
  accelerator path (triton kernels, vLLM's rotary op) and cannot run. ``conftest.py``
  sets it before SGLang is first imported, since SGLang reads it once per process.
- The CUDA-only parts of the HiCache path are stood in for (``engine_standins``), and
  ``torchvision``/``sgl_kernel`` are stand-in packages (``standins/``).
- TP > 1 needs ``SGLANG_CPU_OMP_THREADS_BIND`` (one core set per rank, ``|``-separated)
  when there are fewer NUMA nodes than ranks; this splits the cores the test may use.

Why the stand-ins reach the engine's processes through ``sitecustomize``: SGLang starts
its children with ``multiprocessing``'s ``spawn`` (fresh interpreters that re-import
SGLang), so patching modules in the test process does not reach them, and SGLang offers no
hook that runs in a child before its host pool is built. Python imports ``sitecustomize``
from its path at every interpreter start; while an engine starts and runs,
``PYTHONPATH`` names ``standins/`` (which holds that ``sitecustomize.py``, the
``torchvision`` and ``sgl_kernel`` stand-ins) and this folder (``engine_standins``,
``recording_backend``), and ``KVOFFLOAD_SGLANG_STANDINS=1`` tells ``sitecustomize`` to
install the stand-ins' import hook. The alternatives were worse: a ``.pth`` file in the
SGLang environment would patch every process of that environment, tests or not; wrapping
SGLang's process targets depends on private names that change between releases. The
variables are restored when the engine shuts down.

Process hygiene, and the SGLang behaviours a test process must not inherit:

- SGLang 0.5.23's ``Engine.shutdown()`` SIGKILLs *every* child process of the calling
  process (``kill_process_tree(os.getpid(), include_parent=False)``), not only its own:
  another engine's processes, a ``redis-server`` or ``mooncake_master`` the test started.
  ``RunningEngine.shutdown()`` runs it with that call narrowed to this engine's processes
  (those new after its start, and their descendants); afterwards it waits for them and
  kills (by PID) any still alive, listed in ``RunningEngine.killed``. A storage backend
  is never closed either way (no ``close()`` call): its scheduler process is killed.
- When one of its processes fails (a storage backend that does not load, a scheduler
  that raises), SGLang's SIGQUIT handlers kill the whole process tree *including the
  calling process* (SIGKILL): a pytest run would vanish with exit code 137 and no report.
  The harness passes ``custom_sigquit_handler`` (used while the engine starts); the
  tokenizer manager installs its own SIGQUIT handler on the event loop with its request
  loop, lazily, at the first request, so the harness creates that loop at once and then
  replaces the handler: both raise ``EngineChildFailed`` in the test instead, which fails
  it. Every SGLang path that would still kill the test process itself
  (``kill_process_tree`` of the caller with ``include_parent``, e.g. when the tokenizer
  manager's request loop raises) raises ``EngineChildFailed`` there instead.
- SGLang sets uvloop's event loop policy when it is imported. uvloop runs a Python signal
  handler inside one of its callbacks and only logs what the handler raises, so neither
  ``EngineChildFailed`` nor pytest-timeout's failure reached a test waiting on the loop: a
  scheduler that exited on an error during ``flush_cache()`` left the test, and the run,
  waiting for ever. The harness's engines run on a stock asyncio loop, out of whose
  ``run_until_complete`` such an exception propagates at once.
- All engines of a test process share its one event loop, and an engine's tokenizer
  manager leaves its tasks (the request loop, a watchdog) on it after ``shutdown()``. Once
  its ZMQ sockets are closed, the next engine's first request ran that loop again, the old
  request loop raised on its closed socket, and SGLang's handler for that SIGKILLed the
  whole test process (a loaded run died so, at random, between two engine tests). An
  engine's shutdown cancels its tasks and lets them finish before its sockets close.
- SGLang's watchdog of an engine's processes (a thread) reads any of them dying as a crash
  and signals the calling process; its own stop waits 2 s for the thread, which a loaded
  machine can exceed, and the processes are then killed under it: the harness waits
  until that thread has ended before anything is killed.
- A ZMQ socket SGLang leaves open with unsent messages (after a failed start, or to
  processes already killed) blocks its context's ``term()`` forever when the context is
  collected; pytest collects garbage at exit, so the run would hang there. The contexts an
  engine made are destroyed without lingering when it stops or fails to start.

- SGLang hashes HiCache pages with a C++ extension (``hicache_hash_cpp``) that torch
  compiles at its first use in a process, into ``TORCH_EXTENSIONS_DIR`` (by default one
  folder under ``~/.cache`` for every environment, and rebuilt whenever the source's path
  differs, as it does in each fresh clone). That first use is in a scheduler's HiCache
  prefetch thread; ``flush_cache()`` joins that thread for only 10 s, and under load the
  compile took longer (15 s, seen in a fresh clone's CI run beside two busy loops), so the
  scheduler raised "Failed to stop HiCache storage threads cleanly" and exited. The harness
  gives this environment a folder of its own (``<sys.prefix>/torch_extensions`` unless
  ``TORCH_EXTENSIONS_DIR`` is set) and builds the extension there, in a fresh interpreter,
  before its first engine starts; an engine's processes then only load it.
- An engine whose process has exited answers no request: ``generate()`` and
  ``flush_cache()`` first check that its processes are alive and raise
  ``EngineChildFailed`` naming the dead ones, so a test after one whose engine failed fails
  at once instead of waiting for pytest-timeout.

Idle engines poll without sleeping unless ``sleep_on_idle`` is set; the harness sets it,
so that engines kept alive by fixtures do not take the CPU from the running one.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import signal
import string
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
STANDINS = HERE / "standins"
PAGE_SIZE = 16
#: device KV pool size in tokens (the host pool is hicache_ratio=2 times it)
DEVICE_TOKENS = 8192

__all__ = [
    "EngineChildFailed",
    "Generation",
    "RunningEngine",
    "start_engine",
    "engine_environment",
    "kvoffload_extra_config",
    "recording_extra_config",
    "file_extra_config",
    "prompt_of",
    "wait_until",
    "build_native_hash",
    "torch_extensions_folder",
]


class EngineChildFailed(RuntimeError):
    """One of an engine's processes failed (SGLang signalled the test process with SIGQUIT)."""


def _child_failed(signum: int = 0, frame: Any = None) -> None:
    raise EngineChildFailed(
        "an SGLang engine process failed (SIGQUIT from a child); its log is above (log level: "
        "KVOFFLOAD_SGLANG_LOG_LEVEL)"
    )


def _guard_the_test_process() -> None:
    """Makes SGLang's ``kill_process_tree`` raise ``EngineChildFailed`` instead of killing
    the test process and all its children; idempotent."""
    import sglang.srt.entrypoints.engine  # noqa: F401  (the modules that call it, imported first)
    import sglang.srt.managers.tokenizer_manager  # noqa: F401
    import sglang.srt.utils.common as common

    original = getattr(common.kill_process_tree, "_kvoffload_original", common.kill_process_tree)

    def guarded(parent_pid: Any, include_parent: bool = True, *args: Any, **kwargs: Any) -> None:
        if include_parent and parent_pid in (None, os.getpid()):
            _child_failed()  # the engine's processes are stopped by its shutdown, by PID
        return original(parent_pid, include_parent, *args, **kwargs)

    guarded._kvoffload_original = original  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("sglang") and getattr(module, "kill_process_tree", None) is original:
            module.kill_process_tree = guarded


def _use_a_stock_event_loop() -> None:
    """Replaces the uvloop policy SGLang sets at import by asyncio's own (see the module
    docstring); idempotent, and done before an engine takes the thread's loop."""
    import sglang.srt.entrypoints.engine  # noqa: F401  (the modules that set uvloop's policy)
    import sglang.srt.managers.tokenizer_manager  # noqa: F401

    if type(asyncio.get_event_loop_policy()) is not asyncio.DefaultEventLoopPolicy:
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())


def _stop_watchdog(tokenizer_manager: Any) -> None:
    """Stops SGLang's watchdog of the engine's processes and waits until its thread ended:
    its own stop waits 2 s, and a thread still running when the processes are killed reads
    their deaths as a crash and signals the test process (``EngineChildFailed``)."""
    watchdog = getattr(tokenizer_manager, "_subprocess_watchdog", None)
    if watchdog is None:
        return
    thread = getattr(watchdog, "_thread", None)
    watchdog.stop()
    if thread is not None:
        thread.join(timeout=60)


def _finish_tasks(tokenizer_manager: Any) -> None:
    """Cancels the tokenizer manager's tasks on the test process's event loop and lets them
    end, so that none runs again on a closed socket when the next engine uses the loop."""
    tasks = [t for t in getattr(tokenizer_manager, "asyncio_tasks", ()) if not t.done()]
    loop = getattr(tokenizer_manager, "event_loop", None)
    if not tasks or loop is None or loop.is_closed() or loop.is_running():
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _zmq_contexts() -> dict[int, Any]:
    import zmq

    # type(), not isinstance(): some objects (torch.distributed.reduce_op) warn on __class__
    return {id(o): o for o in gc.get_objects() if issubclass(type(o), zmq.Context)}


def _close_zmq(contexts: list[Any]) -> None:
    """Close the ZMQ contexts (and their sockets) an engine made, without lingering: an
    open socket with unsent messages (to processes now dead) would block its context's
    ``term()`` forever, and pytest collects garbage at exit (the run would hang there)."""
    import zmq

    for context in contexts:
        if context is getattr(zmq.Context, "_instance", None) or context.closed:
            continue
        with suppress(Exception):
            context.destroy(linger=0)


def _descendants(procs: list[psutil.Process]) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for proc in procs:
        with suppress(psutil.NoSuchProcess):
            if proc.is_running():
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
    return list(found.values())


@dataclass
class Generation:
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    details: dict[str, Any]

    @property
    def device(self) -> int:
        return int(self.details.get("device", 0))

    @property
    def host(self) -> int:
        return int(self.details.get("host", 0))

    @property
    def storage(self) -> int:
        return int(self.details.get("storage", 0))


def prompt_of(tokens: int, seed: int = 0) -> str:
    """A prompt of exactly ``tokens`` tokens for the tiny Llama (one token per ASCII
    character), the same for the same seed, different from its first page on for others."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(tokens))


def torch_extensions_folder() -> Path:
    """Where torch builds (and an engine's processes load) SGLang's C++ extensions: the
    user's ``TORCH_EXTENSIONS_DIR``, or a folder of this environment."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


_BUILT: set[Path] = set()
_BUILD_NATIVE_HASH = (
    "from sglang.srt.mem_cache.utils import get_hash_str; "
    "assert len(get_hash_str(list(range(32)), None, page_size=16)) == 2"
)


def build_native_hash(timeout: float = 600.0) -> None:
    """Builds SGLang's HiCache hash extension into ``torch_extensions_folder()`` in a fresh
    interpreter with this process's environment (see the module docstring), once per folder
    and process; a build that fails raises ``RuntimeError`` with its output."""
    folder = torch_extensions_folder()
    if folder in _BUILT:
        return
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_NATIVE_HASH], env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        output = done.stdout + done.stderr
        raise RuntimeError(f"building SGLang's hicache_hash_cpp in {folder} failed:\n{output}")
    _BUILT.add(folder)


def _omp_binding(tp_size: int) -> str:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp_size:
        cores = cores * tp_size
    per = len(cores) // tp_size
    groups = [cores[i * per : (i + 1) * per] for i in range(tp_size)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


@contextmanager
def engine_environment(tp_size: int = 1) -> Iterator[None]:
    """The variables an engine's child processes need (see the module docstring), set
    while the block runs and restored after."""
    path = [str(STANDINS), str(HERE)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    values = {
        "PYTHONPATH": os.pathsep.join(path),
        "KVOFFLOAD_SGLANG_STANDINS": "1",
        "SGLANG_USE_CPU_ENGINE": "1",
        "TORCH_EXTENSIONS_DIR": str(torch_extensions_folder()),
    }
    if tp_size > 1:
        values["SGLANG_CPU_OMP_THREADS_BIND"] = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND") or _omp_binding(
            tp_size
        )
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class RunningEngine:
    engine: Any
    children: list[psutil.Process]
    start_seconds: float
    killed: list[int] = field(default_factory=list)
    _env: Any = None
    _zmq: list[Any] = field(default_factory=list)

    def _require_alive(self) -> None:
        dead = [p.pid for p in self.children if p.pid not in self.alive_children()]
        if dead:
            raise EngineChildFailed(f"this engine's processes {dead} have exited; it answers no request")

    def generate(self, prompt: str | list[int], max_new_tokens: int = 8) -> Generation:
        self._require_alive()
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        if isinstance(prompt, str):
            out = self.engine.generate(prompt=prompt, sampling_params=params)
        else:
            out = self.engine.generate(input_ids=list(prompt), sampling_params=params)
        meta = out["meta_info"]
        return Generation(
            text=out["text"],
            output_ids=list(out.get("output_ids") or []),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            # SGLang reports no details (None) when nothing was cached
            details=dict(meta.get("cached_tokens_details") or {}),
        )

    def flush_cache(self) -> None:
        """Empty the engine's device and host caches (the storage backend keeps its pages).

        SGLang's flush stops its storage threads and clears their queues: a backup to
        storage still queued is dropped, so wait for the writes you expect first."""
        self._require_alive()
        result = self.engine.flush_cache()
        success = getattr(result, "success", True)
        if not success:
            raise RuntimeError(f"flush_cache failed: {result!r}")

    def alive_children(self) -> list[int]:
        alive = []
        for proc in self.children:
            with suppress(psutil.NoSuchProcess):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
        return alive

    def shutdown(self, timeout: float = 30.0) -> None:
        import sglang.srt.entrypoints.engine as engine_module

        original = engine_module.kill_process_tree
        mine = _descendants(self.children)

        def kill_this_engine(parent_pid: Any, include_parent: bool = True, *args: Any, **kwargs: Any) -> None:
            if parent_pid not in (None, os.getpid()) or include_parent:
                return original(parent_pid, include_parent, *args, **kwargs)
            for proc in mine:
                with suppress(psutil.NoSuchProcess):
                    proc.kill()
            psutil.wait_procs(mine, timeout=timeout)

        engine_module.kill_process_tree = kill_this_engine
        try:
            _stop_watchdog(self.engine.tokenizer_manager)
            _finish_tasks(self.engine.tokenizer_manager)
            self.engine.shutdown()
        finally:
            engine_module.kill_process_tree = original
            _close_zmq(self._zmq)
            _, alive = psutil.wait_procs(mine, timeout=timeout)
            for proc in alive:
                with suppress(psutil.NoSuchProcess):
                    proc.kill()
                    self.killed.append(proc.pid)
            psutil.wait_procs(alive, timeout=10)
            if self._env is not None:
                self._env.__exit__(None, None, None)
                self._env = None


def start_engine(
    model_path: str,
    *,
    storage_backend: str | None,
    extra_config: Mapping[str, Any] | None = None,
    tp_size: int = 1,
    layout: str = "layer_first",
    page_size: int = PAGE_SIZE,
    **overrides: Any,
) -> RunningEngine:
    """Start ``sglang.Engine`` on the CPU with HiCache (``--hicache-io-backend direct``,
    host layout ``layout``: ``layer_first`` or ``page_first_direct``; the other layouts
    need CUDA kernels) and the storage backend ``storage_backend`` (``file``, ``dynamic``,
    ... or None for none) configured by ``extra_config``. ``overrides`` are further
    ``ServerArgs`` fields."""
    if layout not in ("layer_first", "page_first_direct"):
        raise ValueError(f"layout {layout!r} needs CUDA kernels; use layer_first or page_first_direct")
    import engine_standins

    engine_standins.install()
    import sglang

    _guard_the_test_process()
    _use_a_stock_event_loop()
    args: dict[str, Any] = {
        "model_path": model_path,
        "device": "cpu",
        "tp_size": tp_size,
        "page_size": page_size,
        "max_total_tokens": DEVICE_TOKENS,
        "enable_hierarchical_cache": True,
        "hicache_io_backend": "direct",
        "hicache_mem_layout": layout,
        "hicache_storage_backend": storage_backend,
        "random_seed": 0,
        "sleep_on_idle": True,
        "custom_sigquit_handler": _child_failed,
        "log_level": os.environ.get("KVOFFLOAD_SGLANG_LOG_LEVEL", "error"),
    }
    if extra_config is not None:
        args["hicache_storage_backend_extra_config"] = json.dumps(dict(extra_config))
    args.update(overrides)

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    contexts_before = _zmq_contexts()
    env = engine_environment(tp_size)
    env.__enter__()
    started = time.monotonic()
    try:
        build_native_hash()
        engine = sglang.Engine(**args)
    except BaseException:
        env.__exit__(None, None, None)
        _close_zmq([c for key, c in _zmq_contexts().items() if key not in contexts_before])
        new = [proc for proc in me.children(recursive=True) if proc.pid not in before]
        for proc in new:
            with suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(new, timeout=10)
        raise
    seconds = time.monotonic() - started
    children = [p for p in me.children(recursive=True) if p.pid not in before]
    # the tokenizer manager's running-phase SIGQUIT handler (on the event loop, installed
    # with its request loop) kills the test process: create that loop now, then replace the
    # handler (see the module docstring)
    tokenizer_manager = engine.tokenizer_manager

    async def create_handle_loop() -> None:  # on the engine's loop, which runs its requests
        tokenizer_manager.auto_create_handle_loop()

    engine.loop.run_until_complete(create_handle_loop())
    engine.loop.remove_signal_handler(signal.SIGQUIT)
    signal.signal(signal.SIGQUIT, _child_failed)
    contexts = [c for key, c in _zmq_contexts().items() if key not in contexts_before]
    return RunningEngine(engine=engine, children=children, start_seconds=seconds, _env=env, _zmq=contexts)


def file_extra_config(directory: str | os.PathLike) -> dict[str, Any]:
    """SGLang's own ``file`` backend, its pages under ``directory``."""
    return {"file_storage_path": str(directory)}


def recording_extra_config(
    record_dir: str | os.PathLike, inner: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``recording_backend.RecordingStorage`` through SGLang's ``dynamic`` backend, its
    records under ``record_dir``; wrapping the backend whose extra config is ``inner``
    (e.g. ``kvoffload_extra_config(...)``), or keeping pages in memory without one."""
    config: dict[str, Any] = {
        "backend_name": "recording",
        "module_path": "recording_backend",
        "class_name": "RecordingStorage",
        "interface_v1": 1,
        "record_dir": str(record_dir),
    }
    if inner is not None:
        config["inner"] = dict(inner)
    return config


def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.05) -> bool:
    """Polls ``predicate()`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def kvoffload_extra_config(
    root_dir: str | os.PathLike, bytes_to_use: int = 256 << 20, **more: Any
) -> dict[str, Any]:
    """kvoffload's backend (``kvoffload.integrations.sglang.KVOffloadStorage``) through
    SGLang's ``dynamic`` backend, with a disk tier under ``root_dir``."""
    return {
        "backend_name": "kvoffload",
        "module_path": "kvoffload.integrations.sglang",
        "class_name": "KVOffloadStorage",
        "interface_v1": 1,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir), "bytes_to_use": bytes_to_use}],
        **more,
    }
