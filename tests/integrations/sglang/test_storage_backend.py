"""kvoffload's SGLang HiCache storage backend against SGLang 0.5.23's own host pools, config
and backend factory (no engine): every layout's pages stored and read back in place,
restart from disk, namespaces apart, a corrupt page a counted miss, the whole-page
interface, configuration errors naming the key."""

from __future__ import annotations

import pytest
import torch
from sglang_pools import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE,
    backend,
    host_indices,
    mha_pool,
    mla_pool,
    page_bytes,
    page_keys,
)

from kvoffload.integrations.sglang.pages import PageViews


def fs(tmp_path, size: int = 64 << 20, **extra) -> dict:
    return {
        "interface_v1": 1,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "bytes_to_use": size}],
        **extra,
    }


POOLS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]


def make_pool(kind: str, layout: str, seed: int = 0):
    return (mha_pool if kind == "mha" else mla_pool)(layout, seed)


@pytest.mark.parametrize("kind, layout", POOLS)
def test_a_pages_views_are_the_page_sglang_hands_out(kind, layout) -> None:
    pool = make_pool(kind, layout, seed=3)
    views = PageViews(pool)
    assert views.num_blocks == pool.page_num
    for page in (0, 1, pool.page_num - 1):
        mine = torch.cat([t[page] for t in views.tensors])
        assert torch.equal(mine, page_bytes(pool, page))


@pytest.mark.parametrize("kind, layout", POOLS)
def test_pages_stored_from_one_pool_load_into_another_after_a_restart(tmp_path, kind, layout) -> None:
    source, target = make_pool(kind, layout, seed=1), make_pool(kind, layout, seed=2)
    keys, pages = page_keys(6), [3, 7, 1, 9, 2, 4]
    first = backend(source, fs(tmp_path))
    assert first.batch_exists(keys) == 0
    assert first.batch_set_v1(keys, host_indices(pages)) == [True] * 6
    assert first.batch_exists(keys) == 6
    first.close()

    second = backend(target, fs(tmp_path))  # a new engine on the same folder
    assert second.batch_exists(keys) == 6
    into = [10, 11, 12, 13, 14, 15]
    assert second.batch_get_v1(keys, host_indices(into)) == [True] * 6
    for src, dst in zip(pages, into):
        assert torch.equal(page_bytes(target, dst), page_bytes(source, src))
    assert second.tiers.counters().loaded_pages == 6
    second.close()


def test_a_prefix_is_what_exists(tmp_path) -> None:
    pool = mha_pool("page_first")
    storage = backend(pool, fs(tmp_path))
    keys = page_keys(5)
    storage.batch_set_v1(keys[:3], host_indices([0, 1, 2]))
    assert storage.batch_exists(keys) == 3
    assert storage.batch_exists(keys[1:]) == 2
    assert storage.batch_exists([keys[4], *keys[:3]]) == 0
    assert storage.exists(keys[0]) is True and storage.exists(keys[3]) is False
    storage.close()


def test_namespaces_keep_other_layouts_ranks_and_models_apart(tmp_path) -> None:
    keys = page_keys(3)
    writer = backend(mha_pool("page_first"), fs(tmp_path))
    writer.batch_set_v1(keys, host_indices([0, 1, 2]))
    writer.close()
    others = [
        backend(mha_pool("layer_first"), fs(tmp_path)),  # another byte order
        backend(mha_pool("page_first"), fs(tmp_path), tp_rank=1, tp_size=2),  # another rank's heads
        backend(mha_pool("page_first"), fs(tmp_path), model="other"),
        backend(mha_pool("page_first", heads=4), fs(tmp_path)),
    ]
    for other in others:
        assert other.batch_exists(keys) == 0
        other.close()
    same = backend(mha_pool("page_first", seed=9), fs(tmp_path))
    assert same.batch_exists(keys) == 3
    same.close()


def test_a_corrupt_page_is_a_counted_miss_and_never_reaches_the_pool(tmp_path) -> None:
    source = mha_pool("page_first_direct", seed=1)
    storage = backend(source, fs(tmp_path))
    keys = page_keys(6)
    storage.batch_set_v1(keys, host_indices(range(6)))
    storage.close()
    # flip one byte of page 3's payload in the slot files
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= 6 * 1024)
    original = page_bytes(source, 3).numpy().tobytes()
    hits = 0
    for path in files:
        data = bytearray(path.read_bytes())
        at = data.find(original[:256])
        if at >= 0:
            data[at + 100] ^= 0xFF
            path.write_bytes(bytes(data))
            hits += 1
    assert hits == 1

    target = mha_pool("page_first_direct", seed=2)
    reader = backend(target, fs(tmp_path))
    assert reader.batch_exists(keys) == 6
    got = reader.batch_get_v1(keys, host_indices(range(20, 26)))
    assert got == [True, True, True, False, False, False]
    for i in range(3):
        assert torch.equal(page_bytes(target, 20 + i), page_bytes(source, i))
    assert not torch.equal(page_bytes(target, 23), page_bytes(source, 3))
    counters = reader.tiers.counters()
    assert counters.failed_load_pages == 1
    assert reader.batch_exists(keys) == 3  # the bad page is gone from the tier
    worker = reader.tiers.workers[0].counters()
    assert worker.corrupt_blocks >= 1  # (each read that found it bad: the job's, then the page's alone)
    assert reader.errors == 0
    reader.close()


def test_the_whole_page_interface_stores_the_same_bytes(tmp_path) -> None:
    source, target = mha_pool("layer_first", seed=1), mha_pool("layer_first", seed=2)
    keys = page_keys(4)
    whole = backend(source, fs(tmp_path, interface_v1=0))
    values = [source.get_data_page(p * PAGE) for p in range(4)]
    assert whole.batch_set(keys, values) is True
    assert whole.batch_exists(keys) == 4
    dummies = [target.get_dummy_flat_data_page() for _ in keys]
    got = whole.batch_get(keys, dummies)
    assert all(g is not None for g in got)
    for p, data in enumerate(got):
        target.set_from_flat_data_page(p * PAGE, data)
        assert torch.equal(page_bytes(target, p), page_bytes(source, p))
    with pytest.raises(RuntimeError, match="interface_v1"):
        whole.batch_get_v1(keys, host_indices(range(4)))
    whole.close()
    # the zero-copy interface of the next engine reads them in place
    zero = backend(mha_pool("layer_first", seed=3), fs(tmp_path))
    assert zero.batch_get_v1(keys, host_indices(range(4))) == [True] * 4
    assert torch.equal(page_bytes(zero.mem_pool_host, 2), page_bytes(source, 2))
    zero.close()


def test_a_full_tier_evicts_by_its_policy_and_stays_within_its_bytes(tmp_path) -> None:
    pool = mha_pool("page_first")
    page = PageViews(pool).block_bytes
    storage = backend(pool, fs(tmp_path, size=8 * (page + 4096)))
    capacity = storage.tiers.tier_stats()[0].capacity
    keys = page_keys(capacity + 6)
    for i, key in enumerate(keys):
        assert storage.batch_set_v1([key], host_indices([i % pool.page_num])) == [True]
    assert storage.batch_exists(keys[-capacity:]) == capacity
    assert storage.batch_exists(keys[:1]) == 0
    stats = storage.tiers.tier_stats()[0]
    assert stats.used == capacity and stats.evictions == 6
    storage.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"secondary_tiers": []}, "secondary_tiers"),
        ({"secondary_tiers": [{"type": "fs", "root_dir": "/tmp/x"}]}, "bytes_to_use"),
        (
            {"secondary_tiers": [{"type": "fs", "root_dir": "/tmp/x", "bytes_to_use": 1 << 20, "nope": 1}]},
            "nope",
        ),
        ({"secondary_tiers": [{"type": "fs", "root_dir": "/x", "bytes_to_use": 1}], "speed": 3}, "speed"),
        (
            {
                "secondary_tiers": [{"type": "fs", "root_dir": "/x", "bytes_to_use": 1}],
                "eviction_policy": "x",
            },
            "eviction_policy",
        ),
        (
            {"secondary_tiers": [{"type": "fs", "root_dir": "/x", "bytes_to_use": 1}], "exists_wait_s": -1},
            "exists_wait_s",
        ),
        (
            {
                "secondary_tiers": [{"type": "fs", "root_dir": "/x", "bytes_to_use": 1}],
                "kv_events_endpoint": "x",
            },
            "kv_events_endpoint",
        ),
    ],
)
def test_bad_configuration_names_the_key(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        backend(mha_pool("page_first"), extra)


def test_bad_page_keys_and_slots_name_the_value(tmp_path) -> None:
    storage = backend(mha_pool("page_first"), fs(tmp_path))
    with pytest.raises(ValueError, match="64 hex digits"):
        storage.batch_exists(["abc"])
    with pytest.raises(ValueError, match="slot 2"):
        storage.batch_set_v1(page_keys(1), torch.arange(2, 2 + PAGE))
    with pytest.raises(ValueError, match="shape"):
        storage.batch_get_v1(page_keys(2), host_indices([0]))
    storage.close()


def test_mla_with_several_ranks_on_the_disk_tier_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="MLA"):
        backend(mla_pool("page_first"), fs(tmp_path), tp_rank=0, tp_size=2)


def test_mla_ranks_share_one_namespace_and_only_the_writer_writes(tmp_path) -> None:
    # (one process here; on the disk tier an MLA model runs on one rank, see the test above)
    keys = page_keys(2)
    first = backend(mla_pool("page_first_direct", seed=1), fs(tmp_path))
    assert first.writer
    first.batch_set_v1(keys, host_indices([0, 1]))
    first.close()
    again = backend(mla_pool("page_first_direct", seed=2), fs(tmp_path))
    assert again.batch_exists(keys) == 2
    again.close()
