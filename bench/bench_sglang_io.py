"""The storage part of an SGLang disk hit: kvoffload's backend against SGLang's own ``file``
backend on the same host pool and pages, same run, cold page cache.

    .venv/sglang/bin/python bench/bench_sglang_io.py [--tokens 4096] [--layers 32] [--kv-heads 8]
        [--head-dim 128] [--page 64] [--rounds 3]

SGLang 0.5.23's own ``MHATokenToKVPoolHost`` (bf16, a Llama-3-8B-like page by default: 32
layers, 8 KV heads of 128, 64 tokens, 8 MiB a page) in ``layer_first`` (the layout both
backends can serve). A prompt's pages are written by each backend as SGLang writes them
(kvoffload: ``batch_set_v1`` from the pool; ``file``: ``batch_set`` of
``get_data_page`` copies), flushed to the disk and dropped from the page cache
(``posix_fadvise(DONTNEED)``), then read back as SGLang reads them on a hit: kvoffload's
``batch_get_v1`` into the pool's pages; the ``file`` backend's ``batch_get`` into staging
pages and ``set_from_flat_data_page`` into the pool (SGLang's ``_generic_page_get``). In
batches of 128 pages, SGLang's ``STORAGE_BATCH_SIZE``. Checked: the pages read equal the
pages written. Printed: each backend's read time and GB/s, the ratio, and the same with a
warm page cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE.parent / "tests" / "integrations" / "sglang"
sys.path[:0] = [str(HARNESS), str(HARNESS / "standins")]
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import sglang_pools  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_pools import host_indices, page_keys, storage_config  # noqa: E402

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def _drop_page_cache(root: Path) -> None:
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _batches(count: int):
    for start in range(0, count, BATCH):
        yield start, min(count, start + BATCH)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    pages = args.tokens // args.page
    sglang_pools.LAYERS, sglang_pools.HEAD_DIM, sglang_pools.PAGE = args.layers, args.head_dim, args.page
    sglang_pools.TOKENS = pages * args.page
    source = sglang_pools.mha_pool("layer_first", seed=1, heads=args.kv_heads)
    target = sglang_pools.mha_pool("layer_first", seed=2, heads=args.kv_heads)
    page_bytes = source.get_data_page(0).numel() * source.dtype.itemsize
    total = pages * page_bytes
    print(
        f"pool: layer_first bf16, {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, page "
        f"{args.page} tokens = {page_bytes / 2**20:.1f} MiB; {pages} pages = {total / 2**30:.2f} GiB a prompt"
    )
    results: dict[str, dict[str, list[float]]] = {"kvoffload": {}, "file": {}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVOFFLOAD_BENCH_DIR")) as tmp:
        for round_ in range(args.rounds):
            keys = page_keys(pages, salt=f"round{round_}")
            # kvoffload: zero copy
            kv_root = Path(tmp) / f"kv{round_}"
            extra = {
                "backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang",
                "class_name": "KVOffloadStorage", "interface_v1": 1,
                "secondary_tiers": [
                    {"type": "fs", "root_dir": str(kv_root), "bytes_to_use": 2 * total + (64 << 20)}
                ],
            }  # fmt: skip
            kv = StorageBackendFactory.create_backend("dynamic", storage_config(extra), source)
            kv.register_mem_pool_host(source)
            for a, b in _batches(pages):
                assert all(kv.batch_set_v1(keys[a:b], host_indices(range(a, b), args.page)))
            kv.close()
            # a restarted engine reads them into its pool
            kv = StorageBackendFactory.create_backend("dynamic", storage_config(extra), target)
            kv.register_mem_pool_host(target)
            for cache in ("cold", "warm"):
                if cache == "cold":
                    _drop_page_cache(kv_root)
                start = time.perf_counter()
                for a, b in _batches(pages):
                    assert all(kv.batch_get_v1(keys[a:b], host_indices(range(a, b), args.page)))
                results["kvoffload"].setdefault(cache, []).append(time.perf_counter() - start)
            kv.close()
            _check(source, target, pages, args.page)
            target.kv_buffer.zero_()

            # SGLang's file backend: the generic path
            file_root = Path(tmp) / f"file{round_}"
            files = HiCacheFile(storage_config({"file_storage_path": str(file_root)}), str(file_root))
            for a, b in _batches(pages):
                values = [source.get_data_page(p * args.page) for p in range(a, b)]
                assert files.batch_set(keys[a:b], values)
            for cache in ("cold", "warm"):
                if cache == "cold":
                    _drop_page_cache(file_root)
                start = time.perf_counter()
                for a, b in _batches(pages):
                    dummies = [target.get_dummy_flat_data_page() for _ in range(a, b)]
                    got = files.batch_get(keys[a:b], dummies)
                    for p, data in zip(range(a, b), got):
                        assert data is not None
                        target.set_from_flat_data_page(p * args.page, data)
                results["file"].setdefault(cache, []).append(time.perf_counter() - start)
            _check(source, target, pages, args.page)
            target.kv_buffer.zero_()

    for cache in ("cold", "warm"):
        kv_s = statistics.median(results["kvoffload"][cache])
        file_s = statistics.median(results["file"][cache])
        rounds = ", ".join(
            f"{k * 1e3:.0f}/{f * 1e3:.0f}"
            for k, f in zip(results["kvoffload"][cache], results["file"][cache])
        )
        print(
            f"{cache} page cache: kvoffload {kv_s * 1e3:8.1f} ms ({total / kv_s / 1e9:5.2f} GB/s)   "
            f"file {file_s * 1e3:8.1f} ms ({total / file_s / 1e9:5.2f} GB/s)   "
            f"kvoffload / file {kv_s / file_s:.2f}x   (rounds, kvoffload/file ms: {rounds})"
        )
    return 0


def _check(source, target, pages: int, page: int) -> None:
    for p in (0, pages // 2, pages - 1):
        if not torch.equal(sglang_pools.page_bytes(source, p), sglang_pools.page_bytes(target, p)):
            raise AssertionError(f"page {p} read back differs")


if __name__ == "__main__":
    sys.exit(main())
