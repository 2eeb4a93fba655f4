"""Tenant isolation in the standalone hasher: cache salts, LoRA adapters and multimodal
items give ``BlockHasher`` the hashes vLLM 0.32 gives the same request (its own request
block hasher, on real ``vllm.v1.request.Request`` objects), and the untagged per-block
form its KV events carry."""

from __future__ import annotations

import pytest

from kvoffload.keys import BlockHasher, MMPlaceholder, block_extra_keys, event_extra_keys, hash_request

pytestmark = pytest.mark.timeout(120)  # importing vLLM alone takes seconds on a loaded machine

BS = 16
TOKENS = list(range(1000, 1000 + 7 * BS + 5))  # 7 full blocks and a partial one
# an item inside block 0, one across blocks 1-3, one starting exactly at block 5
MM = [MMPlaceholder("img-a", 3, 6), MMPlaceholder("img-b", 20, 30), MMPlaceholder("img-c", 80, 16)]


def test_salt_goes_into_the_first_block_and_so_into_every_hash():
    plain = hash_request(TOKENS, BS)
    a = hash_request(TOKENS, BS, cache_salt="tenant-a")
    b = hash_request(TOKENS, BS, cache_salt="tenant-b")
    assert len(plain) == len(a) == len(b) == 7
    # the chain carries the salt of block 0 into every later block
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert block_extra_keys(0, BS, cache_salt="tenant-a") == (("cache_salt", "tenant-a"),)
    assert block_extra_keys(BS, 2 * BS, cache_salt="tenant-a") is None
    assert hash_request(TOKENS, BS, cache_salt="") == plain  # vLLM ignores an empty salt


def test_lora_needs_its_path_and_fixed_keys_do_not_mix_with_per_block_ones():
    with pytest.raises(ValueError, match="lora_path"):
        hash_request(TOKENS, BS, lora_name="sql")
    with pytest.raises(ValueError, match="not both"):
        hash_request(TOKENS, BS, extra_keys=("x",), cache_salt="s")
    with pytest.raises(ValueError, match="start_token"):
        BlockHasher().hash_chain(TOKENS, BS, start_token=-1)


def test_multimodal_items_are_keyed_where_they_overlap_a_block():
    keys = [block_extra_keys(s, s + BS, mm_features=MM) for s in range(0, 7 * BS, BS)]
    assert keys == [
        (("mm", "img-a", 3),),
        (("mm", "img-b", 4),),
        (("mm", "img-b", -12),),
        (("mm", "img-b", -28),),
        None,
        (("mm", "img-c", 0),),
        None,
    ]
    assert event_extra_keys(keys[2]) == (("img-b", -12),)
    both = block_extra_keys(0, BS, cache_salt="s", lora_name="sql", lora_path="/a/sql", mm_features=MM)
    assert both == (("lora", "sql", "/a/sql"), ("mm", "img-a", 3), ("cache_salt", "s"))
    assert event_extra_keys(both) == ("sql", ("img-a", 3), "s")
    assert event_extra_keys(None) is None


def test_a_continued_chain_knows_where_it_starts():
    hasher = BlockHasher()
    whole = hasher.hash_request(TOKENS, BS, cache_salt="s", mm_features=MM)
    tail = hasher.hash_request(TOKENS[2 * BS :], BS, parent_hash=whole[1], mm_features=MM, start_token=2 * BS)
    assert tail == whole[2:]


def _vllm_request(cache_salt=None, lora=None, mm=()):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256_cbor)
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=item.identifier,
            mm_position=PlaceholderRange(offset=item.offset, length=item.length),
        )  # fmt: skip
        for item in mm
    ]
    return Request(
        "r",
        list(TOKENS),
        SamplingParams(max_tokens=1),
        None,
        mm_features=features or None,
        lora_request=None if lora is None else LoRARequest(lora[0], 1, lora[1]),
        cache_salt=cache_salt,
        block_hasher=kv_cache_utils.get_request_block_hasher(BS, sha256_cbor),
    )


CASES = {
    "plain": {},
    "salt": {"cache_salt": "tenant-a"},
    "other salt": {"cache_salt": "tenant-b"},
    "lora": {"lora": ("sql", "/adapters/sql")},
    "same lora name, other weights": {"lora": ("sql", "/adapters/sql-v2")},
    "images": {"mm": MM},
    "all": {"cache_salt": "tenant-a", "lora": ("sql", "/adapters/sql"), "mm": MM},
}


def test_same_hashes_as_vllm_for_the_same_request(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seen: dict[bytes, str] = {}
    for name, case in CASES.items():
        request = _vllm_request(**case)
        theirs = [bytes(h) for h in request.block_hashes]
        lora = case.get("lora") or (None, None)
        ours = BlockHasher(kv_cache_utils.get_none_hash_seed()).hash_request(
            TOKENS, BS, cache_salt=case.get("cache_salt"), lora_name=lora[0], lora_path=lora[1],
            mm_features=case.get("mm", ()),
        )  # fmt: skip
        assert ours == theirs, name
        # and the extra keys of each block are vLLM's, in the tagged and the event form
        mm_idx = 0
        for start in range(0, 7 * BS, BS):
            expected, mm_idx = kv_cache_utils.generate_block_hash_extra_keys(
                request, start, start + BS, mm_idx
            )
            got = block_extra_keys(
                start, start + BS, cache_salt=case.get("cache_salt"), lora_name=lora[0], lora_path=lora[1],
                mm_features=case.get("mm", ()),
            )  # fmt: skip
            assert got == expected, (name, start)
            assert [event_extra_keys(got)] == (kv_cache_utils.to_event_extra_keys([expected]) or [None])
        for h in ours:  # no two cases share any block
            assert seen.setdefault(h, name) == name
