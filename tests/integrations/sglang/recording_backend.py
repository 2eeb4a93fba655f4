"""A HiCache storage backend that records how SGLang calls it. Test scaffolding only.

``RecordingStorage`` either wraps another backend (``inner``: that backend's own extra
config, with its ``module_path`` and ``class_name``; it is built as SGLang's ``dynamic``
factory builds it, with a copy of the storage config carrying that extra config) and
passes every call through, or, without ``inner``, keeps pages in memory itself (a dict
per scheduler process). Either way SGLang uses the v1 interface (``interface_v1: 1``:
``batch_exists``, ``batch_set_v1``, ``batch_get_v1``, reading and writing the host pool's
pages in place), the interface kvoffload's backend implements. Every call SGLang makes,
and every attribute it probes that the class lacks, is appended as one JSON line to
``<record_dir>/calls-<pid>.jsonl`` (``record_dir`` from the extra config): the method,
the process, TP rank and thread, a description of each argument (types, tensor
dtypes/shapes, key counts, the ``extra_info`` content, whether the host indices are whole
contiguous pages) and of the result.

Load it with ``hicache_storage_backend="dynamic"`` and the extra config
``{"backend_name": "recording", "module_path": "recording_backend", "class_name":
"RecordingStorage", "interface_v1": 1, "record_dir": ..., "inner": {...}}``
(``engine.recording_extra_config``); the engine's processes import it from this folder
(``engine.py`` puts it on their path). ``read_calls(record_dir)`` returns the records of
every process, in time order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

__all__ = ["RecordingStorage", "read_calls", "describe"]


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "Tensor",
        "dtype": str(t.dtype),
        "shape": list(t.shape),
        "device": str(t.device),
        "contiguous": t.is_contiguous(),
    }
    if t.dim() == 1 and t.numel() and not t.is_floating_point():
        values = t.tolist()
        out["first"] = values[:3]
        out["last"] = values[-1]
    return out


def describe(value: Any, depth: int = 0) -> Any:
    """A JSON-able description of an argument: enough to see its type and shape."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= 80 else value[:77] + "..."
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, bool) for v in value):
            return list(value)  # per-page results, whole
        kinds = sorted({type(v).__name__ for v in value})
        out: dict[str, Any] = {"type": f"{type(value).__name__}[{','.join(kinds)}]", "len": len(value)}
        if value and isinstance(value[0], str):
            out["first"] = value[0]
            out["key_len"] = len(value[0])
            out["all"] = list(value)
        elif value and depth < 2:
            out["items"] = [describe(v, depth + 1) for v in value[:3]]
        return out
    if isinstance(value, dict):
        if depth >= 3:
            return {"type": "dict", "len": len(value)}
        return {str(k): describe(v, depth + 1) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: describe(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    return {"type": type(value).__name__, "repr": repr(value)[:120]}


def _pages_contiguous(host_indices: torch.Tensor, page_size: int) -> bool:
    """Whether the indices are whole pages: each run of ``page_size`` starts at a multiple
    of ``page_size`` and counts up by one."""
    if host_indices.numel() % page_size:
        return False
    pages = host_indices.reshape(-1, page_size).to(torch.long)
    starts = pages[:, :1]
    return bool((starts % page_size == 0).all() and (pages - starts == torch.arange(page_size)).all())


class RecordingStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = storage_config.extra_config or {}
        self._record_dir = Path(extra["record_dir"])
        self._record_dir.mkdir(parents=True, exist_ok=True)
        self._write_lock = threading.Lock()
        self._pages: dict[str, torch.Tensor] = {}
        self._tp_rank = storage_config.tp_rank
        self.storage_config = storage_config
        self._record("__init__", storage_config=storage_config, kwargs=kwargs)
        self._inner: HiCacheStorage | None = None
        inner = extra.get("inner")
        if inner:
            cls = StorageBackendFactory._load_backend_class(
                inner["module_path"], inner["class_name"], inner.get("backend_name", "inner")
            )
            self._inner = cls(dataclasses.replace(storage_config, extra_config=dict(inner)), kwargs)

    # --- recording ---------------------------------------------------------------------------

    def _record(self, method: str, result: Any = None, **args: Any) -> None:
        entry = {
            "t": time.time(),
            "pid": os.getpid(),
            "tp_rank": self.__dict__.get("_tp_rank"),
            "thread": threading.current_thread().name,
            "method": method,
            "args": {name: describe(value) for name, value in args.items()},
            "result": describe(result),
        }
        line = json.dumps(entry, default=repr) + "\n"
        with self._write_lock, open(self._record_dir / f"calls-{os.getpid()}.jsonl", "a") as f:
            f.write(line)

    def __getattr__(self, name: str) -> Any:
        # only reached for names the class does not define: SGLang probing for optional
        # methods (passed on to the inner backend, if any, after recording)
        if name.startswith("__") or "_write_lock" not in self.__dict__:
            raise AttributeError(name)
        inner = self.__dict__.get("_inner")
        found = inner is not None and hasattr(inner, name)
        self._record("getattr-miss", found, name=name)
        if found:
            return getattr(inner, name)
        raise AttributeError(name)

    def _host_index_info(self, host_indices: torch.Tensor) -> dict[str, Any]:
        page_size = self.mem_pool_host.page_size
        return {"page_size": page_size, "whole_pages": _pages_contiguous(host_indices, page_size)}

    # --- registration ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._record(
            "register_mem_pool_host",
            pool=type(mem_pool_host).__name__,
            layout=mem_pool_host.layout,
            page_size=mem_pool_host.page_size,
            size=mem_pool_host.size,
            kv_buffer=getattr(mem_pool_host, "kv_buffer", None),
            dtype=str(mem_pool_host.dtype),
        )
        if self._inner is not None:
            self._inner.register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._record("register_mem_host_pool_v2", pool=type(host_pool).__name__, name=str(host_pool_name))
        if self._inner is not None:
            self._inner.register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        self._record("on_host_pools_registered")
        if self._inner is not None:
            self._inner.on_host_pools_registered()

    # --- the v1 interface --------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        started = time.perf_counter()
        if self._inner is not None:
            hits = self._inner.batch_exists(keys, extra_info)
        else:
            hits = 0
            for key in keys:
                if key not in self._pages:
                    break
                hits += 1
        self._record(
            "batch_exists", hits, keys=keys, extra_info=extra_info, seconds=time.perf_counter() - started
        )
        return hits

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        started = time.perf_counter()
        if self._inner is not None:
            result = self._inner.batch_set_v1(keys, host_indices, extra_info)
        else:
            page_size = self.mem_pool_host.page_size
            for i, key in enumerate(keys):
                index = int(host_indices[i * page_size])
                self._pages[key] = self.mem_pool_host.get_data_page(index, flat=True).clone()
            result = [True] * len(keys)
        self._record(
            "batch_set_v1",
            result,
            keys=keys,
            host_indices=host_indices,
            indices=self._host_index_info(host_indices),
            extra_info=extra_info,
            seconds=time.perf_counter() - started,
        )
        return result

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        started = time.perf_counter()
        if self._inner is not None:
            result = self._inner.batch_get_v1(keys, host_indices, extra_info)
        else:
            page_size = self.mem_pool_host.page_size
            result = []
            for i, key in enumerate(keys):
                page = self._pages.get(key)
                if page is not None:
                    self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * page_size]), page)
                result.append(page is not None)
        self._record(
            "batch_get_v1",
            result,
            keys=keys,
            host_indices=host_indices,
            indices=self._host_index_info(host_indices),
            extra_info=extra_info,
            seconds=time.perf_counter() - started,
        )
        return result

    # --- the rest of HiCacheStorage (recorded; with interface_v1 SGLang should not call the
    # whole-page ones). Without an inner backend: in memory, or SGLang's defaults.

    def _pass(self, method: str, fallback: Any, *args: Any, **described: Any) -> Any:
        result = getattr(self._inner, method)(*args) if self._inner is not None else fallback()
        self._record(method, result, **described)
        return result

    def exists(self, key: str) -> bool:
        return self._pass("exists", lambda: key in self._pages, key, key=key)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        def fallback() -> torch.Tensor | None:
            page = self._pages.get(key)
            if page is None or target_location is None:
                return page
            return target_location.copy_(page)

        return self._pass(
            "get", fallback, key, target_location, target_sizes, key=key, target_location=target_location
        )

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        def fallback() -> list:
            return [self._pages.get(key) for key in keys]

        return self._pass(
            "batch_get",
            fallback,
            keys,
            target_locations,
            target_sizes,
            keys=keys,
            target_locations=target_locations,
        )

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        def fallback() -> bool:
            self._pages[key] = value.clone()
            return True

        return self._pass("set", fallback, key, value, target_location, target_sizes, key=key, value=value)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        def fallback() -> bool:
            for key, value in zip(keys, values):
                self._pages[key] = value.clone()
            return True

        return self._pass(
            "batch_set", fallback, keys, values, target_locations, target_sizes, keys=keys, values=values
        )

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        def fallback() -> Any:
            return HiCacheStorage.batch_exists_v2(self, keys, pool_transfers, extra_info)

        return self._pass(
            "batch_exists_v2",
            fallback,
            keys,
            pool_transfers,
            extra_info,
            keys=keys,
            pool_transfers=pool_transfers,
            extra_info=extra_info,
        )

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        def fallback() -> Any:
            return HiCacheStorage.batch_get_v2(self, transfers, extra_info)

        return self._pass(
            "batch_get_v2", fallback, transfers, extra_info, transfers=transfers, extra_info=extra_info
        )

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        def fallback() -> Any:
            return HiCacheStorage.batch_set_v2(self, transfers, extra_info)

        return self._pass(
            "batch_set_v2", fallback, transfers, extra_info, transfers=transfers, extra_info=extra_info
        )

    def clear(self) -> Any:
        return self._pass("clear", self._pages.clear, pages=len(self._pages))

    def get_stats(self) -> Any:
        return self._pass("get_stats", lambda: None)

    def close(self) -> None:
        inner = self._inner
        self._record("close", pages=len(self._pages))
        if inner is not None and hasattr(inner, "close"):
            inner.close()


def read_calls(record_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every process's records under ``record_dir``, in time order."""
    calls = []
    for path in sorted(Path(record_dir).glob("calls-*.jsonl")):
        calls.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return sorted(calls, key=lambda c: c["t"])
