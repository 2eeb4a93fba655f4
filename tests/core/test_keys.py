import hashlib

import pytest

from kvoffload.keys import (
    BlockHasher,
    external_hash,
    hash_request,
    key_block_hash,
    key_group,
    make_offload_key,
)

# CBOR written out by hand (RFC 8949), so these vectors do not depend on cbor2.
SEED_CBOR = b"\x6e" + b"vllm-none-hash"  # text string of 14 bytes
NONE_HASH = hashlib.sha256(SEED_CBOR).digest()


def _block_cbor(parent: bytes, tokens: bytes) -> bytes:
    # array(3) [ bytes(32) parent, array(len) tokens (each < 24), null ]
    return b"\x83\x58\x20" + parent + bytes([0x80 + len(tokens)]) + tokens + b"\xf6"


def test_none_hash_is_sha256_of_cbor_seed():
    assert BlockHasher().none_hash == NONE_HASH
    assert NONE_HASH.hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"


def test_hash_request_chains_full_blocks_only():
    first = hashlib.sha256(_block_cbor(NONE_HASH, bytes([0, 1, 2, 3]))).digest()
    second = hashlib.sha256(_block_cbor(first, bytes([4, 5, 6, 7]))).digest()
    assert hash_request(list(range(10)), 4) == [first, second]  # tokens 8, 9 are partial
    assert hash_request(list(range(3)), 4) == []


def test_seed_and_extra_keys_change_hashes():
    base = hash_request(list(range(8)), 4)
    assert hash_request(list(range(8)), 4, seed="other") != base
    assert hash_request(list(range(8)), 4, extra_keys=("lora-a",)) != base
    assert BlockHasher("other").none_hash == hashlib.sha256(b"\x65other").digest()


def test_parent_hash_continues_a_chain():
    hasher = BlockHasher()
    whole = hasher.hash_request(list(range(12)), 4)
    tail = hasher.hash_request(list(range(4, 12)), 4, parent_hash=whole[0])
    assert tail == whole[1:]


@pytest.mark.parametrize("pythonhashseed", [None, "1234"])
def test_matches_vllm_hash_block_tokens(monkeypatch, pythonhashseed):
    """Our chain equals vLLM's for the seed vLLM resolves: its fixed default when
    PYTHONHASHSEED is unset (which must be ours), and PYTHONHASHSEED when it is set."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor

    if pythonhashseed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", pythonhashseed)
    tokens = list(range(100, 164))
    expected = []
    try:
        kv_cache_utils.init_none_hash(sha256_cbor)
        seed = kv_cache_utils.get_none_hash_seed()
        parent = None
        for start in range(0, 64, 16):
            parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start : start + 16], None)
            expected.append(bytes(parent))
    finally:  # leave vLLM's process-wide seed as this process's environment gives it
        monkeypatch.undo()
        kv_cache_utils.init_none_hash(sha256_cbor)
    assert seed == (pythonhashseed or "vllm-none-hash")
    assert BlockHasher(seed).hash_request(tokens, 16) == expected
    if pythonhashseed is None:
        assert hash_request(tokens, 16) == expected  # the default hasher is vLLM's default


def test_offload_key_round_trip():
    h = bytes(range(32))
    key = make_offload_key(h, 3)
    assert key == h + b"\x00\x00\x00\x03"
    assert key_block_hash(key) == h
    assert key_group(key) == 3


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_offload_key_rejects_bad_group(bad):
    with pytest.raises(ValueError, match=str(bad)):
        make_offload_key(b"\x01" * 8, bad)


def test_key_helpers_reject_non_keys():
    with pytest.raises(ValueError):
        key_group(b"\x00\x01")


def test_external_hash_is_unsigned_64_bit_tail():
    h = b"\xaa" * 24 + b"\xff" * 8
    assert external_hash(h) == 2**64 - 1
    assert external_hash(b"\x00" * 24 + (2**63).to_bytes(8, "big")) == 2**63


@pytest.mark.parametrize("bad", [0, -4, 2.0])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        hash_request([1, 2, 3], bad)
