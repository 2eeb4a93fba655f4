"""BlockIndex: exact per-engine per-tier prefix scores for hand-made event streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvoffload.index import DEVICE, DISK, HOST, SHARED, BlockIndex, TierWeights, tier_of
from kvoffload.index.scoring import GroupMasks, prefix_levels
from kvoffload.keys import BlockHasher, external_hash

MODEL, TENANT, BS = "m", "default", 16
H = [1000 + i for i in range(12)]  # a prompt of 12 blocks (hash values are arbitrary u64s)


def stored(hashes, medium="GPU", locality=None, block_size=BS, **kw) -> BlockStored:
    return BlockStored(list(hashes), None, [], block_size, None, medium, None, locality=locality, **kw)


def removed(hashes, medium="GPU", locality=None, **kw) -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, locality=locality, **kw)


def levels(index: BlockIndex, hashes=H, **kw) -> dict[tuple, tuple]:
    result = index.query_hashes(MODEL, TENANT, hashes, **kw)
    return {(m.instance_id, m.dp_rank): m.levels for m in result.matches}


@pytest.fixture
def index() -> BlockIndex:
    return BlockIndex()


def test_tiers_from_medium_and_locality() -> None:
    assert tier_of(None) == tier_of("GPU") == DEVICE
    assert tier_of("CPU") == tier_of("cpu_pinned") == HOST
    assert tier_of("STORAGE", "LOCAL") == tier_of("STORAGE") == tier_of("DISK") == DISK
    assert tier_of("STORAGE", "REMOTE") == tier_of("EXTERNAL") == SHARED
    assert tier_of("TAPE") is None and tier_of(5) is None  # type: ignore[arg-type]


def test_cumulative_levels_per_engine_and_rank(index: BlockIndex) -> None:
    a0 = index.add_engine(MODEL, TENANT, "a", 0, BS)
    a1 = index.add_engine(MODEL, TENANT, "a", 1, BS)
    b = index.add_engine(MODEL, TENANT, 7, 0, BS)
    index.apply(a0, [stored(H[:5]), stored(H[:8], "CPU"), stored(H[8:10], "STORAGE", "LOCAL")])
    index.apply(a1, [stored(H[:2]), stored(H[3:6], "STORAGE", "LOCAL"), stored(H[2:3], "STORAGE", "REMOTE")])
    # b: nothing on device; host has blocks 0-1, then 3: the host run stops at block 2
    index.apply(b, [stored(H[:2] + H[3:4], "CPU"), stored(H[2:3], "STORAGE", "REMOTE")])
    assert levels(index) == {
        ("a", 0): (5, 8, 10, 10),
        ("a", 1): (2, 2, 2, 6),  # block 2 only in shared storage, 3-5 on disk
        (7, 0): (0, 2, 2, 4),
    }


def test_device_blocks_after_a_device_miss_do_not_count(index: BlockIndex) -> None:
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    # device: 0, 1, 3, 4 (2 evicted); host: 2 only
    index.apply(e, [stored(H[:2] + H[3:5]), stored(H[2:3], "CPU")])
    assert levels(index)[("e", 0)] == (2, 3, 3, 3)


def test_weighted_score_counts_each_block_at_the_level_that_reaches_it(index: BlockIndex) -> None:
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    index.apply(
        e, [stored(H[:4]), stored(H[:6], "CPU"), stored(H[6:7], "STORAGE"), stored(H[7:9], "EXTERNAL")]
    )
    (match,) = index.query_hashes(MODEL, TENANT, H).matches
    assert match.levels == (4, 6, 7, 9)
    assert match.weighted == 4 * 1.0 + 2 * 0.75 + 1 * 0.25 + 2 * 0.5
    custom = BlockIndex(TierWeights(device=1, host=0.5, disk=0.0, shared=0.0))
    e = custom.add_engine(MODEL, TENANT, "e", 0, BS)
    custom.apply(e, [stored(H[:4]), stored(H[:6], "CPU"), stored(H[6:7], "STORAGE")])
    assert custom.query_hashes(MODEL, TENANT, H).matches[0].weighted == 5.0


def test_tier_weights_parse_and_validate() -> None:
    assert TierWeights.parse("host=0.5, disk=0.1,gpu=0.9") == TierWeights(0.9, 0.5, 0.1, 0.5)
    assert TierWeights.parse("") == TierWeights()
    with pytest.raises(ValueError, match="'tape=1'"):
        TierWeights.parse("tape=1")
    with pytest.raises(ValueError, match="'lots'"):
        TierWeights.parse("host=lots")
    with pytest.raises(ValueError, match="shared.*1.5"):
        TierWeights(shared=1.5)


def test_duplicate_announcements_are_refcounted_per_engine_tier_and_group(index: BlockIndex) -> None:
    a = index.add_engine(MODEL, TENANT, "a", 0, BS)
    b = index.add_engine(MODEL, TENANT, "b", 0, BS)
    index.apply(a, [stored(H[:3]), stored(H[:3]), stored(H[:3], "CPU")])
    index.apply(b, [stored(H[:3])])
    index.apply(a, [removed(H[:3])])  # one of the two device announcements
    assert levels(index) == {("a", 0): (3, 3, 3, 3), ("b", 0): (3, 3, 3, 3)}
    index.apply(a, [removed(H[:3])])
    assert levels(index) == {("a", 0): (0, 3, 3, 3), ("b", 0): (3, 3, 3, 3)}
    index.apply(a, [removed(H[:3], group_idx=1), removed(H[:3], "CPU")])  # group 1: held by nobody
    assert levels(index)[("a", 0)] == (0, 0, 0, 0)
    assert index.stats().removed_unknown == 3 and index.stats().removed_hashes == 6


def test_all_blocks_cleared_clears_one_engine_in_every_tier(index: BlockIndex) -> None:
    a = index.add_engine(MODEL, TENANT, "a", 0, BS)
    b = index.add_engine(MODEL, TENANT, "b", 0, BS)
    index.apply(a, [stored(H[:4]), stored(H, "CPU"), stored(H, "STORAGE")])
    index.apply(b, [stored(H[:2])])
    assert index.apply(a, [stored(H[:1]), AllBlocksCleared(), stored(H[:1], "CPU")]) is True
    assert levels(index) == {("a", 0): (0, 1, 1, 1), ("b", 0): (2, 2, 2, 2)}
    assert a.blocks == [0, 1, 0, 0] and index.stats().cleared_applied == 1


def test_strided_tiers_hold_the_blocks_their_spans_cover(index: BlockIndex) -> None:
    # kvoffload with 4 device blocks per offloaded block announces every 4th hash, the
    # one ending each span, at 4 x the block size.
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    index.apply(e, [stored(H[:2]), stored([H[3], H[7], H[11]], "CPU", block_size=4 * BS)])
    assert levels(index)[("e", 0)] == (2, 12, 12, 12)
    assert levels(index, H[:10])[("e", 0)] == (2, 8, 8, 8)  # the span 8..11 is cut
    index.apply(e, [removed([H[7]], "CPU")])
    assert levels(index)[("e", 0)] == (2, 4, 4, 4)


def test_hybrid_groups_count_blocks_only_where_the_group_needs_them(index: BlockIndex) -> None:
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    # A 40-token window needs ceil(39 / 16) = 3 blocks before the prefix's end.
    window = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 40}
    index.apply(e, [stored(H[:10], **full), stored(H[4:7], **window), stored(H[8:9], **window)])
    assert levels(index)[("e", 0)] == (7, 7, 7, 7)  # blocks 4..6 end at 7; 8 alone is too short
    index.apply(e, [stored(H[7:8], "CPU", **window)])
    assert levels(index)[("e", 0)] == (7, 9, 9, 9)  # 6 (gpu), 7 (cpu), 8 (gpu): ends at 9
    mamba = {"group_idx": 2, "kv_cache_spec_kind": "mamba"}
    index.apply(e, [stored(H[5:6], **mamba)])  # a state after block 5 only
    assert levels(index)[("e", 0)] == (0, 0, 0, 0)  # no length with both windows satisfied
    index.apply(e, [stored(H[6:7], **mamba)])
    assert levels(index)[("e", 0)] == (7, 7, 7, 7)


def test_lora_adapters_and_tenants_are_separate_namespaces(index: BlockIndex) -> None:
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    other = index.add_engine(MODEL, "acme", "e", 0, BS)
    index.apply(e, [stored(H[:3]), BlockStored(H[:5], None, [], BS, None, "GPU", "sql")])
    index.apply(other, [stored(H)])
    assert levels(index)[("e", 0)] == (3, 3, 3, 3)
    assert levels(index, lora_name="sql")[("e", 0)] == (5, 5, 5, 5)
    index.apply(e, [removed(H[3:5])])  # removals name no adapter: the adapter's holds end
    assert levels(index, lora_name="sql")[("e", 0)] == (3, 3, 3, 3)
    assert index.query_hashes(MODEL, "acme", H).matches[0].levels == (12, 12, 12, 12)


def test_query_by_tokens_hashes_them_like_the_engine(index: BlockIndex) -> None:
    hasher = BlockHasher()
    tokens = list(range(5 * BS + 3))
    hashes = [external_hash(h) for h in hasher.hash_request(tokens, BS)]
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    index.apply(e, [stored(hashes[:3]), stored(hashes, "CPU")])  # placeholder-style: no tokens
    result = index.query_tokens(MODEL, TENANT, tokens)
    assert result.num_blocks == 5 and result.matches[0].levels == (3, 5, 5, 5)
    salted = index.query_tokens(MODEL, TENANT, tokens, cache_salt="s")
    assert salted.matches[0].levels == (0, 0, 0, 0)
    no_hashing = BlockIndex(hash_seed=None)
    e = no_hashing.add_engine(MODEL, TENANT, "e", 0, BS)
    no_hashing.apply(e, [stored(hashes)])
    assert no_hashing.query_tokens(MODEL, TENANT, tokens).matches[0].levels == (0, 0, 0, 0)


def test_query_by_tokens_uses_chains_learned_from_self_describing_events() -> None:
    # An engine with a hash function the index cannot reproduce, announcing its tokens.
    index = BlockIndex(hash_seed="not-the-engines-seed")
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    tokens = list(range(100, 100 + 6 * BS))
    blocks = [tokens[i * BS : (i + 1) * BS] for i in range(6)]
    chain = [9001, 9002, 9003, 9004, 9005, 9006]
    index.apply(
        e,
        [
            BlockStored(chain[:2], None, blocks[0] + blocks[1], BS, None, "GPU", None),
            BlockStored(chain[2:4], chain[1], blocks[2] + blocks[3], BS, None, "GPU", None),
            # the CPU tier offloads two blocks as one: it announces every other hash
            BlockStored([chain[1], chain[3], chain[5]], None, tokens, 2 * BS, None, "CPU", None),
        ],
    )
    assert index.query_tokens(MODEL, TENANT, tokens).matches[0].levels == (4, 6, 6, 6)
    changed = tokens[:BS] + [0] * BS + tokens[2 * BS :]
    assert index.query_tokens(MODEL, TENANT, changed).matches[0].levels == (1, 1, 1, 1)


def test_learned_chains_of_a_lora_adapter_need_its_name() -> None:
    index = BlockIndex()
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    tokens = list(range(2 * BS))
    event = BlockStored([51, 52], None, tokens, BS, None, "GPU", "sql", extra_keys=[("sql",), ("sql",)])
    index.apply(e, [event])
    assert index.query_tokens(MODEL, TENANT, tokens, lora_name="sql").matches[0].levels == (2, 2, 2, 2)
    assert index.query_tokens(MODEL, TENANT, tokens).matches[0].levels == (0, 0, 0, 0)


def test_malformed_events_are_counted_and_skipped(index: BlockIndex) -> None:
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    index.apply(
        e,
        [
            stored(H[:2], "TAPE"),
            stored(H[:2], block_size=24),  # not a multiple of the registered 16
            stored([2**64 + 1]),
            removed(H[:1], "TAPE"),
            stored([b"\x01" * 32]),  # raw hash bytes are converted, not malformed
        ],
    )
    stats = index.stats()
    assert (stats.stored_unknown_tier, stats.stored_bad_block_size, stats.stored_bad_hash) == (1, 1, 1)
    assert stats.removed_unknown_tier == 1 and stats.stored_applied == 1
    assert levels(index, [external_hash(b"\x01" * 32)])[("e", 0)] == (1, 1, 1, 1)


def test_registration_rules_and_unknown_spaces(index: BlockIndex) -> None:
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    with pytest.raises(ValueError, match="block_size 32 differs from the 16"):
        index.add_engine(MODEL, TENANT, "f", 0, 32)
    with pytest.raises(ValueError, match="'e' dp_rank 0 is already registered"):
        index.add_engine(MODEL, TENANT, "e", 0, BS)
    with pytest.raises(LookupError, match="'nope'"):
        index.query_hashes("nope", TENANT, H)
    index.apply(e, [stored(H)])
    index.remove_engine(e)
    with pytest.raises(LookupError):
        index.query_hashes(MODEL, TENANT, H)
    again = index.add_engine(MODEL, TENANT, "e", 0, 32)  # the space was dropped with its last engine
    assert again.slot == e.slot and index.query_hashes(MODEL, TENANT, H).matches[0].levels == (0, 0, 0, 0)


def test_many_engines_span_several_mask_words(index: BlockIndex) -> None:
    engines = [index.add_engine(MODEL, TENANT, f"e{i}", 0, BS) for i in range(40)]
    for i, engine in enumerate(engines):
        index.apply(engine, [stored(H[: i % 12]), stored(H[: (i + 3) % 13], "CPU")])
    got = levels(index)
    for i in range(40):
        device, host = i % 12, max(i % 12, (i + 3) % 13)
        assert got[(f"e{i}", 0)] == (device, host, host, host)


def test_negative_i64_query_hashes_are_read_as_twos_complement(index: BlockIndex) -> None:
    e = index.add_engine(MODEL, TENANT, "e", 0, BS)
    index.apply(e, [stored([2**64 - 1, 2**63])])
    assert levels(index, [-1, -(2**63)])[("e", 0)] == (2, 2, 2, 2)


def _model_levels(nibbles: list[int]) -> tuple[int, int, int, int]:
    """The contract's prefix lengths of one engine, block by block: its device run, then
    per level the run after it of blocks in some tier from the host up to that level."""
    n = len(nibbles)
    device = next((i for i, t in enumerate(nibbles) if not t & 1), n)
    out = [device]
    for level in (1, 2, 3):
        tiers = (1 << (level + 1)) - 2  # host .. level
        end = device
        while end < n and nibbles[end] & tiers:
            end += 1
        out.append(end)
    return (out[0], out[1], out[2], out[3])


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 40),
    engines=st.integers(1, 20),
    groups=st.integers(1, 2),
    held=st.sampled_from([0.5, 0.9, 1.0]),
)
def test_prefix_levels_agree_with_a_block_by_block_model(seed, n, engines, groups, held) -> None:
    """Full-attention groups, engines over one or two mask words, prompts whose tail no
    engine holds (scoring stops there) or that are held to the end."""
    rng = np.random.default_rng(seed)
    nobody_from = int(rng.integers(0, n + 1)) if held < 1.0 else n
    per_group = []
    for _ in range(groups):
        nibbles = (rng.random((engines, n, 4)) < held) @ np.array([1, 2, 4, 8])
        nibbles[:, nobody_from:] = 0
        per_group.append(nibbles.tolist())
    group_masks = []
    for nibbles in per_group:
        words = [np.zeros(n, dtype=np.uint64) for _ in range((engines + 15) // 16)]
        for e, row in enumerate(nibbles):
            words[e // 16] |= np.array(row, dtype=np.uint64) << np.uint64(4 * (e % 16))
        group_masks.append(GroupMasks(words))
    got = prefix_levels(group_masks, list(range(engines)), n)
    for e in range(engines):
        per_level = [_model_levels(nibbles[e]) for nibbles in per_group]
        bound = [min(levels[k] for levels in per_level) for k in range(4)]
        for k in (1, 2, 3):
            bound[k] = max(bound[k], bound[k - 1])
        assert got[e] == tuple(bound), (e, per_group)
