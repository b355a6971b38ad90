"""The scheduler's side of the grammar workers (gramserve/scheduler/grammar_client.py), against two stand-in shards
(ZeroMQ sockets answered by the test): a request that takes the slot of one that stopped while its last fed fill
was still running on another shard has its first fill asked only once that fill is answered, so the two fills
cannot race to write the slot; with the fill already answered nothing waits."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from gramserve.config import LaunchInfo
from gramserve.grammar.grammar_shm import create_grammar_shm
from gramserve.ipc import SCHEDULER_GRAMMAR_IN, grammar_inbox, pull_socket, push_socket
from gramserve.messages import GrammarCompileReq, GrammarRequest, GrammarStepReq, GrammarStepResp
from gramserve.scheduler.grammar_client import GrammarClient

SLOTS, VOCAB = 8, 1000


@pytest.fixture
def rig(tmp_path):
    shm = create_grammar_shm(SLOTS, VOCAB)
    launch = LaunchInfo(ipc_dir=str(tmp_path), grammar_shm=shm.name, vocab_size=VOCAB)
    config = SimpleNamespace(launch=launch, settings=SimpleNamespace(grammar_shards=2, max_running_requests=SLOTS))
    ctx = zmq.Context()
    shards = [pull_socket(ctx, launch.replica_path(grammar_inbox(i))) for i in range(2)]
    client = GrammarClient(config, ctx)
    client.attach(torch.device("cpu"), use_feed=True)
    reply = push_socket(ctx, launch.replica_path(SCHEDULER_GRAMMAR_IN))
    yield client, shards, reply
    client._shared.close()
    ctx.destroy(linger=0)
    shm.close()
    shm.unlink()


def _recv(sock: zmq.Socket, timeout_ms: int = 2000):
    assert sock.poll(timeout_ms), "no message"
    return sock.recv_pyobj()


def _answer(reply: zmq.Socket, step: int, shard: int) -> None:
    reply.send_pyobj(GrammarStepResp(step, [], shard=shard))


def _start(client, shards, reply) -> None:
    """Requests "a" on shard 0 and "b" on shard 1; "a" runs one step, then its next mask comes through the feed
    (fed step 2, not answered yet); then "a" stops."""
    client.compile("a", GrammarRequest("json_object", ""))
    client.compile("b", GrammarRequest("regex", "b+"))  # another grammar: the other shard (the lighter one)
    assert isinstance(_recv(shards[0]), GrammarCompileReq) and isinstance(_recv(shards[1]), GrammarCompileReq)
    pairs, step = client.masks_for([0], ["a"])
    assert pairs == [(0, 0)] and step == 1
    assert _recv(shards[0]).fill == [("a", 0)]
    _answer(reply, 1, 0)
    client.wait(1)
    assert client.announce_feed(1, [0], ["a"]) == 2
    assert isinstance(_recv(shards[0]), GrammarStepReq)
    client.free("a")


def test_a_reused_slot_waits_for_the_last_owners_fed_fill(rig):
    client, shards, reply = rig
    _start(client, shards, reply)
    answered_at = []

    def shard0_finishes_late():
        time.sleep(0.3)
        answered_at.append(time.monotonic())
        _answer(reply, 2, 0)

    late = threading.Thread(target=shard0_finishes_late)
    late.start()
    pairs, step = client.masks_for([0], ["b"])
    asked_at = time.monotonic()
    late.join()
    assert pairs == [(0, 0)]  # "b" took the slot "a" gave back
    assert answered_at and asked_at >= answered_at[0]
    msg = _recv(shards[1])
    assert msg.fill == [("b", 0)] and msg.step == step
    assert client.timing["stale_slot_waits"] == 1


def test_nothing_waits_once_the_fed_fill_is_answered(rig):
    client, shards, reply = rig
    _start(client, shards, reply)
    _answer(reply, 2, 0)
    client.wait(2)
    pairs, step = client.masks_for([0], ["b"])
    assert pairs == [(0, 0)] and _recv(shards[1]).fill == [("b", 0)]
    assert client.timing["stale_slot_waits"] == 0


def test_a_request_goes_where_its_grammar_was_compiled_unless_that_shard_is_busier(rig):
    """Placement (GrammarClient._pick_shard): the lightest shard, unless a shard that had the request's grammar
    lately holds at most AFFINITY_SLACK (2) requests more: no compile, and the request may run before the answer."""
    client, _, _ = rig
    g1, g2, g3 = (GrammarRequest("regex", r) for r in ("a+", "b+", "c+"))
    placed = {}
    for rid, g in (("a", g1), ("b", g2), ("c", g1), ("d", g2), ("e", g3), ("f", g1), ("g", g1), ("h", g1)):
        client.compile(rid, g)
        placed[rid] = client._shard_of[rid]
    # a: 0; b: 1 (lighter); c, d: their grammars' shards at equal load; e: new, the lighter; then shard 0 holds
    # 3, 4 against 2: f and g stay with g1's shard; at 5 against 2, h goes to the lighter one.
    assert placed == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0, "f": 0, "g": 0, "h": 1}


def test_answers_about_freed_requests_are_dropped(rig):
    """Under the token feed a request failed by its first answer (`empty`: its grammar allows nothing) has its
    sampled token refused by the worker one step later; the scheduler has freed it by then, and that late
    `rejected` was kept forever (every later step then looked through the rejections)."""
    client, shards, _ = rig
    client.compile("a", GrammarRequest("regex", "a+"))
    client._on_step(GrammarStepResp(1, [], shard=0, empty=["a"]))
    assert client.take_rejected(["a"]) == {"a": ("the grammar allows no output: no value satisfies it", 400)}
    client.free("a")
    client._on_step(GrammarStepResp(2, ["a"], shard=0, failed={"a": "x"}, empty=["a"]))
    assert client._rejected == {}
