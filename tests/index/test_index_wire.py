"""The index's lazy decoding of token ids, and the token chains' skipping of blocks they
already learned: the same answers as decoding everything and learning every event."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from kvoffload.events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher, decode, encode
from kvoffload.events.codec import EventDecodeError
from kvoffload.events.subscriber import EventSubscriber
from kvoffload.events.types import AllBlocksCleared
from kvoffload.index import BlockIndex, IndexService, Registration
from kvoffload.index.tokens import TokenChains
from kvoffload.index.wire import LazyBlockStored, decode_batch, has_tokens, token_list

MODEL, TENANT, BS = "m", "default", 4


def chain_events(rng: random.Random, blocks: int, chunk: int, medium: str = "GPU") -> tuple[list, list]:
    tokens = [rng.randrange(200_000) for _ in range(blocks * BS)]
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    events = [
        BlockStored(
            hashes[s : s + chunk],
            hashes[s - 1] if s else None,
            tokens[s * BS : (s + chunk) * BS],
            BS,
            None,
            medium,
            None,
        )
        for s in range(0, blocks, chunk)
    ]
    return tokens, events


def test_map_payloads_keep_token_ids_encoded_until_asked() -> None:
    event = BlockStored([1, 2], 7, list(range(8)), BS, None, "CPU", None, group_idx=1)
    batch = decode_batch(encode(KVEventBatch(1.5, [event, BlockRemoved([1], "CPU"), AllBlocksCleared()], 3)))
    lazy, removed, cleared = batch.events
    assert type(lazy) is LazyBlockStored and isinstance(lazy, BlockStored)
    assert type(lazy.token_ids) is msgspec.Raw and token_list(lazy.token_ids) == list(range(8))
    assert (lazy.block_hashes, lazy.parent_block_hash, lazy.medium, lazy.group_idx) == ([1, 2], 7, "CPU", 1)
    assert removed == BlockRemoved([1], "CPU") and cleared == AllBlocksCleared()
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 3)
    assert has_tokens(lazy.token_ids)
    empty = decode_batch(encode(KVEventBatch(0.0, [BlockStored([1], None, [], BS, None, "GPU", None)])))
    assert not has_tokens(empty.events[0].token_ids) and not has_tokens([])


def test_array_payloads_and_garbage_go_through_the_full_decoder() -> None:
    batch = KVEventBatch(2.0, [BlockStored([5], None, [1, 2, 3, 4], BS, None, "GPU", None)], 0)
    got = decode_batch(encode(batch, fmt="array"))
    assert got == decode(encode(batch, fmt="array")) and type(got.events[0]) is BlockStored
    with pytest.raises(EventDecodeError):
        decode_batch(b"\x93\x01\x02")
    # Token ids that are not a list of ints decode to None, so they teach nothing.
    fields = {"block_hashes": [1], "parent_block_hash": None, "token_ids": ["x"], "block_size": BS}
    fields.update(lora_id=None, medium="GPU", lora_name=None)
    bad = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", **fields}], None])
    event = decode_batch(bad).events[0]
    assert token_list(event.token_ids) is None
    chains = TokenChains()
    assert chains.learn(None, event.token_ids, BS, [1], None) == 0 and len(chains) == 0


def test_lazy_and_full_decoding_give_the_same_index() -> None:
    rng = random.Random(4)
    full, lazy = BlockIndex(hash_seed=None), BlockIndex(hash_seed=None)
    engines = [(ix, [ix.add_engine(MODEL, TENANT, i, 0, BS) for i in range(3)]) for ix in (full, lazy)]
    prompts = []
    payloads = []
    for _ in range(6):
        tokens, events = chain_events(rng, 24, 5)
        prompts.append(tokens)
        host = [BlockStored(e.block_hashes, e.parent_block_hash, [], BS, None, "CPU", None) for e in events]
        for i in range(3):
            payloads.append((i, encode(KVEventBatch(0.0, events[: i + 2]))))
            payloads.append((i, encode(KVEventBatch(0.0, events + host))))  # re-announced, then host
    for ix, engs in engines:
        dec = decode if ix is full else decode_batch
        for i, payload in payloads:
            ix.apply(engs[i], dec(payload).events)
    for tokens in prompts:
        answers = [[m.levels for m in ix.query_tokens(MODEL, TENANT, tokens).matches] for ix in (full, lazy)]
        assert answers[0] == answers[1] and answers[0][0][0] == 24  # every chain was learned
    f, z = full.stats(), lazy.stats()
    assert (f.stored_applied, f.stored_hashes) == (z.stored_applied, z.stored_hashes)


def test_re_announced_blocks_are_not_learned_again_but_still_chain() -> None:
    chains = TokenChains()
    tokens = list(range(4 * BS))
    assert chains.learn(None, tokens, BS, [11, 12, 13, 14], None) == 4
    assert chains.learn(12, tokens[2 * BS :], BS, [13, 14], None) == 0  # all known
    assert chains.learn(12, tokens[2 * BS :] + [9] * BS, BS, [13, 14, 15], None) == 3  # one new
    assert chains.chain(tokens + [9] * BS, BS) == [11, 12, 13, 14, 15]
    # Another block size is another chain, even over the same hashes.
    assert chains.learn(None, tokens, 2 * BS, [12, 14], None) == 2
    assert chains.chain(tokens, 2 * BS) == [12, 14]
    # Events with extra keys are always learned (their keys differ).
    assert chains.learn(None, tokens[:BS], BS, [11], [("lora",)]) == 1
    assert chains.chain(tokens[:BS], BS, lambda i: ("lora",)) == [11]


def test_a_hash_whose_key_another_chain_took_over_is_learned_again() -> None:
    chains = TokenChains()
    tokens = list(range(2 * BS))
    assert chains.learn(None, tokens, BS, [1, 2], None) == 2
    assert chains.learn(None, tokens, BS, [7, 8], None) == 2  # another hash function, same tokens
    assert chains.chain(tokens, BS) == [7, 8]
    assert chains.learn(None, tokens, BS, [1, 2], None) == 2  # not skipped: the key says 7
    assert chains.chain(tokens, BS) == [1, 2]


def test_skipping_follows_the_generations() -> None:
    chains = TokenChains(capacity=8)  # generations of 4 entries
    tokens = list(range(4 * BS))
    assert chains.learn(None, tokens, BS, [1, 2, 3, 4], None) == 4  # fills the newest: it ages
    assert chains.chain(tokens, BS) == [1, 2, 3, 4]
    assert chains.learn(None, tokens, BS, [1, 2, 3, 4], None) == 4  # relearned into the newest
    chains.clear()
    assert chains.chain(tokens, BS) == [] and chains.learn(None, tokens, BS, [1, 2, 3, 4], None) == 4


def test_a_subscriber_decodes_with_the_decoder_it_is_given(tmp_path) -> None:
    calls = []

    def decoder(payload: bytes) -> KVEventBatch:
        calls.append(len(payload))
        if len(calls) == 1:
            raise EventDecodeError("refused")
        return decode_batch(payload)

    pub = ZmqEventPublisher(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r")
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, decoder=decoder, replay_timeout=1.0)
    try:
        time.sleep(0.3)
        event = BlockStored([1], None, [1, 2, 3, 4], BS, None, "GPU", None)
        for _ in range(2):
            pub.publish(KVEventBatch(0.0, [event]))
        got = sub.receive(5.0)
        assert got is not None and got[0] == 1 and type(got[1].events[0]) is LazyBlockStored
        assert sub.stats().malformed == 1 and len(calls) == 2
    finally:
        sub.close()
        pub.close()


def test_a_served_index_learns_chains_from_lazily_decoded_events(tmp_path) -> None:
    rng = random.Random(9)
    tokens, events = chain_events(rng, 40, 8)
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r")
    with IndexService(BlockIndex(hash_seed=None), replay_timeout=1.0) as service:
        source = service.register(
            Registration("e", pub.endpoint, MODEL, BS, replay_endpoint=pub.replay_endpoint)
        )
        try:
            pub.publish(KVEventBatch(0.0, events))
            deadline = time.monotonic() + 15
            while source.stats().batches < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            result = service.index.query_tokens(MODEL, TENANT, tokens)
            assert result.matches[0].levels == (40, 40, 40, 40)
            assert service.index.stats().tokens_learned == 40
        finally:
            pub.close()


def test_chains_tell_tokens_parents_extra_keys_and_huge_token_ids_apart() -> None:
    chains = TokenChains()
    tokens = [5, 6, 7, 8, 2**64 + 5, 6, 7, 8]  # a token id beyond u64 still learns and chains
    assert chains.learn(None, tokens, BS, [1, 2], [["mm", 1], None]) == 2  # unhashable extra key
    assert chains.chain(tokens, BS, lambda i: ["mm", 1] if i == 0 else None) == [1, 2]
    assert chains.chain(tokens, BS) == []  # without the extra key the first block differs
    assert chains.learn(3, tokens[:BS], BS, [4], None) == 1  # same tokens, another parent
    assert chains.chain(tokens[:BS], BS) == []
    swapped = [6, 5, 7, 8]  # token order matters
    assert chains.learn(None, swapped, BS, [9], None) == 1 and chains.chain(tokens[:BS], BS) == []
    assert chains.chain(swapped + [1, 2, 3], BS) == [9]  # a partial last block is not looked up
