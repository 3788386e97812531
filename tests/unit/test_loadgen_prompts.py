"""Token-id prompts: exact lengths, and hash_ids reproduced as shared prefixes."""

from __future__ import annotations

import pytest

from loadgen.arrivals import ArrivalConfig, plan_requests
from loadgen.prompts import PromptBuilder
from loadgen.target import RequestSpec
from loadgen.traces import TraceRow, read_mooncake_jsonl, shared_dir


def spec(index: int, input_len: int, hash_ids: tuple[int, ...] = (), block_len: int = 512):
    return RequestSpec(index, 0.0, input_len, 1, hash_ids, block_len)


@pytest.mark.parametrize("input_len", [1, 7, 511, 512, 513, 4000])
def test_prompt_has_exactly_the_requested_token_count(input_len: int) -> None:
    builder = PromptBuilder(vocab_size=1000)
    for hash_ids in [(), (3,), (3, 4, 5, 6, 7, 8, 9, 10)]:
        ids = builder.prompt_ids(spec(0, input_len, hash_ids))
        assert len(ids) == input_len
        assert all(builder.low_id <= i < 1000 for i in ids)


def test_equal_hash_id_prefixes_give_equal_token_prefixes() -> None:
    builder = PromptBuilder(seed=5)
    a = builder.prompt_ids(spec(0, 1500, (0, 1, 2)))
    b = builder.prompt_ids(spec(1, 1400, (0, 1, 9)))
    c = builder.prompt_ids(spec(2, 1500, (7, 1, 2)))
    assert a[:1024] == b[:1024]  # two shared blocks
    assert a[1024:1400] != b[1024:1400]  # third block differs
    assert a[:512] != c[:512]  # a different first id shares nothing
    # Same request again (new builder, same seed): identical prompt, so runs are reproducible.
    assert PromptBuilder(seed=5).prompt_ids(spec(0, 1500, (0, 1, 2))) == a
    assert PromptBuilder(seed=6).prompt_ids(spec(0, 1500, (0, 1, 2))) != a


def test_requests_without_hash_ids_share_no_prefix() -> None:
    builder = PromptBuilder()
    first = builder.prompt_ids(spec(0, 64))
    second = builder.prompt_ids(spec(1, 64))
    assert first[:4] != second[:4]


def test_token_scaled_hash_blocks_still_share_prefixes() -> None:
    rows = [TraceRow(0.0, 2048, 10, (0, 1, 2, 3)), TraceRow(1.0, 1536, 10, (0, 1, 5))]
    specs = list(plan_requests(rows, ArrivalConfig(token_scale=0.125)))
    builder = PromptBuilder()
    a, b = (builder.prompt_ids(s) for s in specs)
    assert (len(a), len(b), specs[0].block_len) == (256, 192, 64)
    assert a[:128] == b[:128] and a[128:192] != b[128:192]


def test_kimi_trace_prefix_sharing_is_reproduced() -> None:
    # In the Kimi conversation trace every request starts with hash id 0 (a shared system prompt).
    rows = []
    for row in read_mooncake_jsonl(shared_dir() / "traces" / "conversation_trace.jsonl"):
        rows.append(row)
        if len(rows) == 20:
            break
    specs = list(plan_requests(rows, ArrivalConfig(token_scale=1 / 8)))
    builder = PromptBuilder()
    prompts = [builder.prompt_ids(s) for s in specs]
    assert [len(p) for p in prompts] == [s.input_len for s in specs]
    first_blocks = {
        tuple(p[:64]) for p, s in zip(prompts, specs, strict=True) if s.hash_ids[0] == 0
    }
    assert len(first_blocks) == 1
