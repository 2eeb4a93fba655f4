"""The scheduler side's per-block extra keys against vLLM's own function, on real ``Request``s."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvoffload.integrations.vllm.scheduler_side import _extra_keys  # noqa: E402

BLOCK = 16


@pytest.mark.parametrize("salt", [None, "", "tenant-1"])
@pytest.mark.parametrize("lora", [None, LoRARequest("sql", 1, "/adapters/sql")])
def test_extra_keys_are_vllms_for_every_block(salt, lora) -> None:
    request = Request(
        request_id="r", prompt_token_ids=list(range(3 * BLOCK)), sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None, lora_request=lora, cache_salt=salt,
    )  # fmt: skip
    starts = range(0, 3 * BLOCK, BLOCK)
    answers = [_extra_keys(request, start, start + BLOCK) for start in starts]
    assert answers == [generate_block_hash_extra_keys(request, s, s + BLOCK, 0)[0] for s in starts]
    # the cases with a source do have keys (so the comparison above is not of Nones only)
    assert (answers[0] is not None) == bool(salt or lora)
