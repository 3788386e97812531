"""A token engine on `kv_transfer: pull` (its `on_*` inputs and `step`, shard links stood in
for): a sharded hand-off joins no decode step until every shard of its group said its KV landed,
an idle engine asks its shards for that news, and a request whose KV a shard lost (its prompt
engine died before the pull, its hold's lease ran out, no room) ends alone and retryably, so the
router re-runs it."""

from __future__ import annotations

import time
from typing import Any

from common.mesh_options import MeshOptions
from common.protocol import AttendResult, DecodeHandoff, KvReadyQuery, SamplingSpec, ShardAddress
from common.roles import Role
from services.engine.engine import Engine
from services.engine.faults import EngineFaults

SHARDS = [ShardAddress("tcp://s0", 0, 1), ShardAddress("tcp://s1", 1, 2)]


class NewsLink:
    """Answers each `KvReadyQuery` with the news it is given."""

    def __init__(self) -> None:
        self.landed: list[str] = []
        self.lost: list[str] = []
        self.asked: list[KvReadyQuery] = []

    def send_async(self, header: Any, tensors: Any) -> None:
        assert isinstance(header, KvReadyQuery)
        self.asked.append(header)

    def wait(self, handle: Any, timeout: float | None = None) -> None:
        pass

    def recv(self, out: Any = None, timeout: float | None = None) -> tuple[AttendResult, list]:
        result = AttendResult(self.asked[-1].step, -1, kv_landed=self.landed, kv_lost=self.lost)
        self.landed, self.lost = [], []
        return result, []


def handoff(req_id: str) -> DecodeHandoff:
    return DecodeHandoff(req_id, [9, 10, 11, 12], 3, SamplingSpec(max_tokens=4), "router",
                         num_kv_layers=4, shards=SHARDS)  # fmt: skip


def token_engine(model_path, links: list[NewsLink], kv_transfer: str) -> Engine:  # type: ignore[no-untyped-def]
    """A token engine over `links` to a two-shard group, KV pushed or pulled."""
    options = MeshOptions(num_blocks=1024, shard_num_blocks=64, kv_transfer=kv_transfer)  # type: ignore[arg-type]
    return Engine.build(
        "t",
        Role.TOKEN,
        options,
        str(model_path),
        lambda *a: None,
        command_endpoint="t-cmd",
        shard_links=links,
        shards=SHARDS,
    )


def test_a_pulled_request_decodes_once_every_shard_has_its_kv(tiny_model_path):
    links = [NewsLink(), NewsLink()]
    engine = token_engine(tiny_model_path, links, "pull")
    engine.on_handoff(handoff("a"))
    engine.on_handoff(handoff("b"))
    assert engine.has_work() and not engine.admission.sharded
    links[0].landed = ["a", "b"]
    assert not engine.step()  # idle: it asked, a and b are on one shard only
    assert [len(link.asked) for link in links] == [1, 1]
    assert not engine.admission.sharded
    links[1].landed, links[1].lost = ["a"], ["b"]
    out = engine.step()
    assert [s.req_id for s in engine.admission.sharded] == ["a"]
    [(reply_to, error)] = out.outputs
    assert (reply_to, error.req_id, error.retryable) == ("router", "b", True)
    assert "lost the request's KV" in error.error
    assert sorted(endpoint for endpoint, _ in out.frees) == ["tcp://s0", "tcp://s1"]
    assert "b" not in engine.table


def test_a_pushed_request_decodes_at_once(tiny_model_path):
    links = [NewsLink(), NewsLink()]
    engine = token_engine(tiny_model_path, links, "push")
    engine.on_handoff(handoff("a"))
    assert [s.req_id for s in engine.admission.sharded] == ["a"]


def test_a_shard_dying_mid_pull_ends_the_waiting_request_retryably(tiny_model_path):
    """The group broke (a shard died, perhaps mid-pull): every request waiting for its KV on it
    ends retryably and its KV is freed on every shard of the old group (the live ones may have
    pulled it); the prompt engine's hold frees its copy when its lease runs out."""
    links = [NewsLink(), NewsLink()]
    engine = token_engine(tiny_model_path, links, "pull")
    engine.on_handoff(handoff("a"))
    links[0].landed = ["a"]
    engine.step()  # landed on s0 only; s1 dies before its pull
    out = EngineFaults(engine).relink([], [], "a shard of its group stopped answering")
    [(_, error)] = out.outputs
    assert (error.req_id, error.retryable) == ("a", True)
    assert sorted(endpoint for endpoint, _ in out.frees) == ["tcp://s0", "tcp://s1"]
    assert not engine.has_work()


def test_requests_held_without_streaming_tell_their_router_they_live(tiny_model_path):
    """Requests an engine holds that stream nothing for a third of the router's progress
    deadline (here: waiting for their KV to land; likewise decodes behind a run of prefill steps)
    get an empty output each, so the router does not re-run them elsewhere; a request that
    streams meanwhile gets none."""
    options = MeshOptions(num_blocks=1024, shard_num_blocks=64, kv_transfer="pull",
                          progress_timeout_s=0.3, shard_rebuild_wait_s=0.1)  # fmt: skip
    links = [NewsLink(), NewsLink()]
    engine = Engine.build("t", Role.TOKEN, options, str(tiny_model_path), lambda *a: None,
                          command_endpoint="t-cmd", shard_links=links, shards=SHARDS)  # fmt: skip
    engine.on_handoff(handoff("a"))
    engine.on_handoff(handoff("b"))
    assert not engine.step().outputs  # a round has just begun: nobody is quiet yet
    time.sleep(0.15)
    assert not engine.step().outputs  # this round notes what each has streamed so far
    time.sleep(0.15)
    out = engine.step()  # the next finds them where they were
    alive = {(reply_to, o.req_id, tuple(o.token_ids), o.index) for reply_to, o in out.outputs}
    # Each at its next token's index (the hand-off brought the first token): nothing skipped.
    assert alive == {("router", "a", (), 1), ("router", "b", (), 1)}
    assert not engine.step().outputs  # told: the next round is a third of the deadline away
