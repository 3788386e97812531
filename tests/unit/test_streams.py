"""`StreamTable` (services/router/streams.py), the stream bookkeeping both engine clients share:
admission bounds, duplicate ids, pending prompt tokens until the first token, late delivery."""

from __future__ import annotations

import asyncio
from secrets import token_hex

import pytest

from common.transport.zmq_auth import CurveKeys
from services.router.streams import AdmissionLimits, Overloaded, Stream, StreamTable


def admit(table: StreamTable[Stream], req_id: str, num_tokens: int) -> Stream:
    def build() -> Stream:
        return Stream(req_id=req_id, num_prompt_tokens=num_tokens)

    return table.admit(req_id, num_tokens, build)


def test_admission_bounds_and_duplicate_ids() -> None:
    async def run() -> None:
        table: StreamTable[Stream] = StreamTable(
            AdmissionLimits(max_num_requests=2, max_pending_prompt_tokens=100)
        )
        admit(table, "a", 60)
        with pytest.raises(ValueError, match="already in use"):
            admit(table, "a", 1)
        with pytest.raises(Overloaded) as refused:
            admit(table, "b", 50)  # 60 + 50 pending > 100
        assert refused.value.reason == "max_pending_prompt_tokens"
        admit(table, "b", 40)
        with pytest.raises(Overloaded) as full:
            admit(table, "c", 1)
        assert full.value.reason == "max_num_requests"
        assert len(table) == 2 and table.num_pending_prompt_tokens == 100

    asyncio.run(run())


def test_pending_tokens_end_at_the_first_token_or_release() -> None:
    async def run() -> None:
        table: StreamTable[Stream] = StreamTable()
        a, _ = admit(table, "a", 10), admit(table, "b", 7)
        assert table.deliver("a", "no tokens yet", has_tokens=False) is a
        assert table.num_pending_prompt_tokens == 17
        table.deliver("a", "first token", has_tokens=True)
        table.deliver("a", "second", has_tokens=True)
        assert table.num_pending_prompt_tokens == 7
        table.release("b")  # closed before its first token
        assert table.num_pending_prompt_tokens == 0
        table.release("a")  # after it: counted once
        assert table.num_pending_prompt_tokens == 0 and len(table) == 0
        assert [await a.outputs.get() for _ in range(3)] == ["no tokens yet", "first token",
                                                             "second"]  # fmt: skip

    asyncio.run(run())


def test_delivery_after_release_is_dropped() -> None:
    async def run() -> None:
        table: StreamTable[Stream] = StreamTable()
        a = admit(table, "a", 3)
        assert table.release("a") is a
        assert table.release("a") is None
        assert table.deliver("a", "late", has_tokens=True) is None
        assert a.outputs.empty() and table.num_pending_prompt_tokens == 0

    asyncio.run(run())


def test_a_request_admitted_but_never_sent_gives_its_slot_back(tiny_model_path) -> None:
    # The mesh client admits, then sends the GenerateRequest: if the send fails, the admission
    # slot and the pending prompt tokens must come back, or the router fills up with ghosts.
    from common.roles import Role
    from common.sampling_params import SamplingParams
    from services.mesh.registry import ServiceEntry
    from services.router.mesh_client import MeshEngineClient

    entries = [
        ServiceEntry(role=Role.PROMPT, service_id="p0", state="ready",
                     command_endpoint="tcp://127.0.0.1:9"),
        ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready",
                     command_endpoint="tcp://127.0.0.1:9"),
    ]  # fmt: skip
    client = MeshEngineClient(
        tiny_model_path, lambda: entries, auth=CurveKeys.from_mesh_key(token_hex(16)), refresh_s=60
    )

    def broken_send(endpoint: str, msg: object) -> None:
        raise OverflowError("cannot be encoded")

    client._send = broken_send  # type: ignore[method-assign]

    async def run() -> None:
        with pytest.raises(OverflowError):
            await anext(client.generate("r1", [5, 6, 7], SamplingParams(max_tokens=4)))

    try:
        asyncio.run(run())
        assert len(client.streams) == 0 and client.streams.num_pending_prompt_tokens == 0
        assert not client.book.ledgers
    finally:
        client.shutdown()
