"""Stand-ins for the CUDA-only parts of SGLang 0.5.23's HiCache path, so that a real
``sglang.Engine`` runs with HiCache on a CPU machine. Test scaffolding only.

SGLang's CPU path serves a model, but its hierarchical cache (device pool -> host pool ->
storage backend) assumes CUDA in four places. Each stand-in below replaces one of them
with plain torch on CPU, keeping SGLang's own semantics (which rows, which layers, which
layout), so the host pool and the storage backends see the bytes the engine computed:

- ``cuda_host_register_noop`` for ``pool_host.common._cuda_host_register``: the host
  pool is allocated by ``alloc_with_host_register``, which pins it with
  ``cudaHostRegister`` (``pin_memory=True`` is fixed in the engine's path). There is
  nothing to pin on a CPU machine: the buffer stays as allocated.
- ``transfer_kv_direct``, ``transfer_kv_all_layer_direct_lf_pf`` and
  ``transfer_kv_per_layer_direct_pf_lf`` for the ``sgl_kernel.kvcacheio`` ops of the
  same names, which the host pools (``pool_host.mha``, ``pool_host.mla``) call for
  ``--hicache-io-backend direct`` with ``layer_first`` and ``page_first_direct`` layouts.
  SGLang imports them only when CUDA/ROCm/XPU is present, so on CPU the names are
  missing from those modules altogether; the stand-ins are set as module globals there.
  (The ``kernel`` io backend and the ``page_first``/``page_head`` layouts need other
  CUDA kernels and are not stood in for.)
- ``get_dummy_flat_data_page_unpinned`` for the host pools' ``get_dummy_flat_data_page``:
  the generic (non zero-copy) read path of storage backends (``cache_controller
  ._generic_page_get``, SGLang's ``file`` backend) reads each page into a staging page
  made with ``pin_memory=self.pin_memory``, which fails without CUDA.
- An importable ``sgl_kernel`` (the stand-in package in ``standins/``, on the path).

How they are applied: SGLang's scheduler and detokenizer run in child processes started
with ``spawn``, which import SGLang afresh. ``install()`` adds a ``sys.meta_path`` hook
that applies the stand-ins to the three ``pool_host`` modules right after each one is
imported (whenever that happens, in whichever process), without importing SGLang
itself. ``engine.py`` arranges for ``install()`` to run in every child through
``standins/sitecustomize.py``; ``conftest.py`` runs it in the test process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "install",
    "installed",
    "cuda_host_register_noop",
    "transfer_kv_direct",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_direct_pf_lf",
    "get_dummy_flat_data_page_unpinned",
    "PATCHED_MODULES",
]

_POOL_HOST = "sglang.srt.mem_cache.pool_host"
_REGISTERED_RANGES_ATTR = "_sglang_cuda_host_registered_ranges"


# --- cudaHostRegister ---------------------------------------------------------------------


def cuda_host_register_noop(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
    """Stands in for ``pool_host.common._cuda_host_register`` (``cudaHostRegister`` of the
    host pool, in chunks). On CPU the buffer is already ordinary host memory: nothing is
    registered, and the buffer records no registered ranges, so the pool's destroy path
    has nothing to unregister."""
    setattr(buffer, _REGISTERED_RANGES_ATTR, [])


# --- host <-> device copies (sgl_kernel.kvcacheio, --hicache-io-backend direct) -----------


def _rows(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return tensor.index_select(0, indices.to(device=tensor.device, dtype=torch.long))


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Stands in for ``sgl_kernel.kvcacheio.transfer_kv_direct``: for each pair of
    token-major tensors (one layer's K or V, or an MLA layer's latent buffer), copies the
    rows ``src_indices`` of the source to the rows ``dst_indices`` of the destination. The
    kernel copies runs of ``page_size`` rows at once; row by row gives the same bytes."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"transfer_kv_direct: {len(src_layers)} source layers, {len(dst_layers)} destination"
        )
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: index counts differ")
    del page_size
    dst_long = None
    for src, dst in zip(src_layers, dst_layers):
        if dst_long is None:
            dst_long = dst_indices.to(device=dst.device, dtype=torch.long)
        dst.index_copy_(0, dst_long, _rows(src, src_indices).to(dst.device))


def _page_split(
    indices: torch.Tensor, page_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    flat = indices.to(device=device, dtype=torch.long)
    return flat // page_size, flat % page_size


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Stands in for ``sgl_kernel.kvcacheio.transfer_kv_all_layer_direct_lf_pf`` (device
    to host, every layer): ``src_ptrs`` are the device's per-layer token-major tensors,
    component by component (MHA: all K layers, then all V layers; MLA: the latent layers);
    ``dst_ptrs`` one ``page_first_direct`` host tensor per component, shaped
    ``[pages, layers, page_size, ...]``. Host token index ``i`` is row ``i % page_size``
    of page ``i // page_size``."""
    components = len(dst_ptrs)
    if components == 0 or len(src_ptrs) % components:
        raise ValueError(
            f"transfer_kv_all_layer_direct_lf_pf: {len(src_ptrs)} source layers for {components} components"
        )
    num_layers = len(src_ptrs) // components
    for c, dst in enumerate(dst_ptrs):
        if dst.shape[1] != num_layers:
            raise ValueError(
                f"transfer_kv_all_layer_direct_lf_pf: host tensor has {dst.shape[1]} layers, not {num_layers}"
            )
        pages, offsets = _page_split(dst_indices, page_size, dst.device)
        for layer in range(num_layers):
            rows = _rows(src_ptrs[c * num_layers + layer], src_indices).to(dst.device)
            dst[:, layer][pages, offsets] = rows.reshape((rows.shape[0], *dst.shape[3:]))


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Stands in for ``sgl_kernel.kvcacheio.transfer_kv_per_layer_direct_pf_lf`` (host to
    device, one layer): ``src_ptrs`` one ``page_first_direct`` host tensor per component
    (``[pages, layers, page_size, ...]``), ``dst_ptrs`` the device's token-major tensors
    of layer ``layer_id``, one per component."""
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(
            f"transfer_kv_per_layer_direct_pf_lf: {len(src_ptrs)} sources, {len(dst_ptrs)} destinations"
        )
    for src, dst in zip(src_ptrs, dst_ptrs):
        pages, offsets = _page_split(src_indices, page_size, src.device)
        rows = src[:, layer_id][pages, offsets]
        dst_long = dst_indices.to(device=dst.device, dtype=torch.long)
        dst.index_copy_(0, dst_long, rows.reshape((rows.shape[0], *dst.shape[1:])).to(dst.device))


_TRANSFER_OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
}


# --- the generic read path's staging page ---------------------------------------------------


class _Unpinned:
    """A read-only view of a host pool whose ``pin_memory`` is False (thread-safe: the pool
    itself is not changed while other threads use it)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: Any) -> None:
        object.__setattr__(self, "_pool", pool)

    def __getattr__(self, name: str) -> Any:
        if name == "pin_memory":
            return False
        return getattr(self._pool, name)


def get_dummy_flat_data_page_unpinned(
    original: Callable[[Any], torch.Tensor],
) -> Callable[[Any], torch.Tensor]:
    """Wraps a host pool class's ``get_dummy_flat_data_page`` (a zeroed staging page made
    with ``pin_memory=self.pin_memory``, which needs CUDA's pinned allocator) so that the
    page is made unpinned: the original runs on a view of the pool whose ``pin_memory`` is
    False. Same shape, dtype and device as SGLang's."""

    def get_dummy_flat_data_page(self: Any) -> torch.Tensor:
        return original(_Unpinned(self))

    get_dummy_flat_data_page.__doc__ = get_dummy_flat_data_page_unpinned.__doc__
    get_dummy_flat_data_page.__wrapped__ = original  # type: ignore[attr-defined]
    get_dummy_flat_data_page._kvoffload_standin = True  # type: ignore[attr-defined]
    return get_dummy_flat_data_page


def _unpin_staging_pages(module: ModuleType) -> None:
    for value in list(vars(module).values()):
        if not isinstance(value, type) or value.__module__ != module.__name__:
            continue
        method = value.__dict__.get("get_dummy_flat_data_page")
        if method is None or getattr(method, "_kvoffload_standin", False):
            continue
        value.get_dummy_flat_data_page = get_dummy_flat_data_page_unpinned(method)


# --- applying them ----------------------------------------------------------------------------


def _patch_common(module: ModuleType) -> None:
    module._cuda_host_register = cuda_host_register_noop


def _patch_pool_module(module: ModuleType) -> None:
    for name, op in _TRANSFER_OPS.items():
        # only where SGLang did not bind the real op (it does on CUDA, ROCm and XPU)
        if not callable(getattr(module, name, None)):
            setattr(module, name, op)
    _unpin_staging_pages(module)


#: module name -> the function that applies its stand-ins (after the module is executed)
PATCHED_MODULES: dict[str, Callable[[ModuleType], None]] = {
    f"{_POOL_HOST}.common": _patch_common,
    f"{_POOL_HOST}.mha": _patch_pool_module,
    f"{_POOL_HOST}.mla": _patch_pool_module,
}

_lock = threading.Lock()
_installed = False


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHED_MODULES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Apply the stand-ins in this process: to the ``pool_host`` modules already imported
    now, and to the others as they are imported. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        sys.meta_path.insert(0, _PatchingFinder())
        for name, patch in PATCHED_MODULES.items():
            module = sys.modules.get(name)
            if module is not None:
                patch(module)
        _installed = True


def installed() -> bool:
    return _installed
