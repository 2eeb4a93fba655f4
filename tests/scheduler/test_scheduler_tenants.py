"""Tenant isolation in the engine-agnostic scheduler: an engine that does not hash gets
its requests hashed with their cache salt, LoRA adapter and multimodal items, so two
tenants never share a block; and every ``BlockStored`` says those extra keys as vLLM
0.32 publishes them (untagged, one entry per block)."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events.types import BlockStored
from kvoffload.keys import BlockHasher, MMPlaceholder, external_hash
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest

TOKENS = list(range(100, 116))  # 4 blocks of 4


@dataclass
class Req:
    """A request view of an engine that leaves hashing to the scheduler."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm_features: tuple = ()
    block_hashes: None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def make(**kwargs):
    manager = CPUOffloadingManager(64, "lru", enable_events=True)
    return OffloadingScheduler(manager, (KVGroup(4),), hash_block_size=4, **kwargs)


def prefill(sched, req, first_block=0):
    n = sched.match(req, 0)
    sched.on_allocated(req.request_id, [list(range(first_block, first_block + 4))], n)
    plan = sched.build_step([StepRequest(req.request_id, None, len(req.all_token_ids))])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    sched.request_finished(req.request_id)
    return n


def test_another_salt_or_adapter_finds_nothing_the_same_one_finds_everything():
    sched = make()
    assert prefill(sched, Req("a", TOKENS, cache_salt="tenant-a")) == 0
    assert sched.match(Req("b", TOKENS, cache_salt="tenant-b"), 0) == 0
    assert sched.match(Req("c", TOKENS), 0) == 0  # no salt is another tenant too
    assert sched.match(Req("d", TOKENS, lora_name="sql", lora_path="/a/sql"), 0) == 0
    assert sched.match(Req("e", TOKENS, cache_salt="tenant-a"), 0) == 15  # all but one token
    for req_id in "bcde":
        sched.request_finished(req_id)


def test_stored_events_carry_the_extra_keys_per_block_as_vllm_publishes_them():
    sched = make()
    image = MMPlaceholder("img-1", 6, 4)  # tokens 6-9: the end of block 1, the start of block 2
    req = Req("a", TOKENS, cache_salt="s", lora_name="sql", lora_path="/a/sql", mm_features=(image,))
    prefill(sched, req)
    hashes = BlockHasher().hash_request(
        TOKENS, 4, cache_salt="s", lora_name="sql", lora_path="/a/sql", mm_features=[image]
    )
    (event,) = sched.take_events()
    assert event == BlockStored(
        block_hashes=[external_hash(h) for h in hashes],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=4,
        lora_id=None,
        medium="CPU",
        lora_name="sql",
        extra_keys=[("sql", "s"), ("sql", ("img-1", 2)), ("sql", ("img-1", -2)), ("sql",)],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def test_an_engines_own_extra_keys_function_is_used_for_hashes_and_events():
    seen = []

    def extra(request, start, end):
        seen.append((request.request_id, start, end))
        return (("cache_salt", "x"),) if start == 0 else None

    sched = make(block_extra_keys=extra)
    prefill(sched, Req("a", TOKENS))
    (event,) = sched.take_events()
    assert event.extra_keys == [("x",), None, None, None]
    assert event.block_hashes[0] == external_hash(BlockHasher().hash_request(TOKENS, 4, cache_salt="x")[0])
    assert ("a", 12, 16) in seen


def test_no_extra_keys_leaves_the_field_out():
    sched = make()
    prefill(sched, Req("a", TOKENS))
    (event,) = sched.take_events()
    assert event.extra_keys is None and event.lora_name is None
