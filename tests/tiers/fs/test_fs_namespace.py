"""Namespaces of the disk tier: every field that changes a block's bytes changes the
directory name; names are stable across processes; bad values are named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvoffload.tiers.fs.format import DIGEST_BYTES
from kvoffload.tiers.fs.namespace import (
    check_namespace,
    describe,
    fs_namespace,
    namespace_digest,
    namespace_identity,
)

BASE = dict(
    model="Qwen/Qwen3-0.6B",
    dtype="bfloat16",
    layout={"page_bytes": [4096] * 4, "groups": [[0, 1, 2, 3]], "blocks_per_offload_block": 1},
    block_size=16,
    kv_cache_groups=[{"kind": "full_attention", "block_size": 16, "num_kv_heads": 8, "head_size": 128}],
    hash_seed="vllm-none-hash",
)


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "other/model"),
        ("dtype", "float16"),
        (
            "layout",
            {"page_bytes": [4096] * 3 + [2048], "groups": [[0, 1, 2, 3]], "blocks_per_offload_block": 1},
        ),
        ("layout", {"page_bytes": [4096] * 4, "groups": [[0, 1, 2, 3]], "blocks_per_offload_block": 4}),
        ("block_size", 32),
        ("kv_cache_groups", [{"kind": "sliding_window", "block_size": 16, "window": 4096}]),
        ("hash_seed", "another-seed"),
        ("rank", 1),
        ("extra", {"tensor_parallel_size": 2}),
    ],
)
def test_every_field_changes_the_namespace(field, value):
    base = fs_namespace(namespace_identity(**BASE))
    changed = fs_namespace(namespace_identity(**{**BASE, field: value}))
    assert changed != base
    assert namespace_digest(changed) != namespace_digest(base)


def test_the_name_is_stable_across_processes_and_key_order():
    name = fs_namespace(namespace_identity(**BASE))
    assert name.startswith("kv-") and len(name) == 35 and check_namespace(name) == name
    assert fs_namespace(dict(reversed(list(namespace_identity(**BASE).items())))) == name
    code = (
        "from kvoffload.tiers.fs.namespace import fs_namespace, namespace_identity;"
        f"print(fs_namespace(namespace_identity(**{BASE!r})))"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == name
    )
    assert len(namespace_digest(name)) == DIGEST_BYTES
    assert '"format_version":1' in describe(namespace_identity(**BASE))


def test_bad_values_are_named():
    with pytest.raises(TypeError, match="namespace field 'dtype' is not JSON-serialisable"):
        fs_namespace(namespace_identity(**{**BASE, "dtype": object()}))
    with pytest.raises(ValueError, match="non-empty mapping"):
        fs_namespace({})
    for bad in ("", ".", "..", "a/b", "a\0b", 3):
        with pytest.raises(ValueError, match="namespace must be a plain directory name"):
            check_namespace(bad)
