"""The pipeline's messages on NCCL: a process group per kind and direction (`Channels`), so that
no generated schedule hangs on NCCL's streams, as a model of them shows.

The model is NCCL's point-to-point as torch drives it without a ``device_id`` (lazy communicators):
a group gives each pair of ranks one communicator and one stream, which runs its sends and
receives in the order they were posted; a send ends together with its receive (as one of more
than NCCL's buffers hold does), so it holds the stream until the receive is at the head of the
peer's stream; an operation starts only once the compute stream has run what was posted before it
(torch makes the NCCL stream wait on the current one); a receive's ``wait()`` holds the compute
stream until the receive has ended. A host blocks only where a pair first uses a group: the
communicator is made by both ranks together. gloo, which the tests run on, holds none of this.
"""

from __future__ import annotations

import pytest

from autopart.ir.actions import Action, Kind, rank_of
from autopart.runtime.p2p import Channels
from autopart.schedule import build_schedule, add_communication, stage_placement

BY_DIRECTION = Channels("activations up", "activations down", "gradients up", "gradients down")
BY_KIND = Channels("activations", "activations", "gradients", "gradients")  # two groups: the runtime before


def _lowered(kind: str, ranks: int, microbatches: int, chunks: int) -> tuple[dict, tuple[int, ...]]:
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    compute = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    return add_communication(compute, ranks=ranks, placement=placement), placement


def _stuck_on_nccl(schedule: dict, placement: tuple[int, ...], channels: Channels, *,
                   connected: bool = False) -> list[str]:
    """What is left waiting when every host and stream has run what it can (none: the step ends);
    a pipeline rank is its global rank here, its messages' groups as the executor asks them.
    ``connected``: each rank first opens its channels as `Executor.connect` does."""
    ranks = len(schedule)
    streams: dict[tuple, list[dict]] = {}  # (rank, "compute") or (rank, group, pair) -> its operations in order
    firsts: dict[int, list[tuple]] = {}  # per rank, in post order, the (group, pair) of each message
    posted: dict[tuple, int] = {}  # (group, sender, receiver, "send" or "recv") -> how many so far
    for rank, actions in schedule.items():
        compute = streams.setdefault((rank, "compute"), [])
        for action in actions:
            if action.kind.is_compute:
                compute.append({"what": str(action)})
                continue
            sends = action.kind in (Kind.SEND_F, Kind.SEND_B)
            peer = rank_of(action.peer_stage, ranks, placement)
            sender, receiver = (rank, peer) if sends else (peer, rank)
            group = channels.for_action(action.kind, rank=rank, peer=peer)
            side = "send" if sends else "recv"
            number = posted.get((group, sender, receiver, side), 0)
            posted[group, sender, receiver, side] = number + 1
            operation = {"what": f"{action} on {group!r}", "message": (group, sender, receiver, number), "side": side,
                         "after": len(compute)}  # what the compute stream had been given when it was posted
            stream = (group, min(rank, peer), max(rank, peer))
            streams.setdefault((rank, *stream), []).append(operation)
            firsts.setdefault(rank, []).append(stream)
            if not sends:
                compute.append({"what": f"wait for {action}", "waits": operation})
    if connected:
        for rank, actions in schedule.items():
            messages = {(a.kind, rank_of(a.peer_stage, ranks, placement)) for a in actions if not a.kind.is_compute}
            opened = [(channels.groups[c], low, high) for c, low, high in Channels.connections(messages, rank)]
            firsts[rank] = opened + firsts.get(rank, [])
    hosts = _hosts_stuck(firsts)
    if hosts:
        return hosts
    ends = {(op["message"], op["side"]): (key, op) for key, ops in streams.items() for op in ops if "message" in op}
    head = dict.fromkeys(streams, 0)

    def startable(key: tuple, op: dict) -> bool:
        return streams[key][head[key]] is op and head[key[0], "compute"] >= op["after"]

    moved = True
    while moved:
        moved = False
        for key, ops in streams.items():
            while head[key] < len(ops):
                op = ops[head[key]]
                if "message" not in op:  # compute, or the wait for a receive that has ended
                    waited = op.get("waits")
                    if waited is not None and not waited.get("ended"):
                        break
                else:
                    other_key, other = ends[op["message"], "recv" if op["side"] == "send" else "send"]
                    if not (startable(key, op) and startable(other_key, other)):
                        break
                    op["ended"] = other["ended"] = True
                    head[other_key] += 1
                head[key] += 1
                moved = True
    return [ops[head[key]]["what"] for key, ops in streams.items() if head[key] < len(ops)]


def _hosts_stuck(firsts: dict[int, list[tuple]]) -> list[str]:
    """The hosts left waiting to make a communicator: each posts its messages in order and stops
    at a (group, pair) not yet made until the peer stops at the same one."""
    made: set[tuple] = set()
    cursor = dict.fromkeys(firsts, 0)
    moved = True
    while moved:
        moved = False
        for rank, streams in firsts.items():
            while cursor[rank] < len(streams) and streams[cursor[rank]] in made:
                cursor[rank] += 1
                moved = True
            if cursor[rank] == len(streams):
                continue
            stream = streams[cursor[rank]]
            peer = stream[2] if stream[1] == rank else stream[1]
            theirs = firsts.get(peer, [])
            if cursor.get(peer, 0) < len(theirs) and theirs[cursor[peer]] == stream:
                made.add(stream)
                moved = True
    return [f"rank {rank}'s host making {firsts[rank][at]}" for rank, at in cursor.items() if at < len(firsts[rank])]


def test_both_ends_of_a_message_name_the_group_of_its_kind_and_direction():
    assert BY_DIRECTION.of(gradients=False, sender=3, receiver=5) == "activations up"
    assert BY_DIRECTION.of(gradients=False, sender=5, receiver=3) == "activations down"
    assert BY_DIRECTION.of(gradients=True, sender=2, receiver=9) == "gradients up"
    assert BY_DIRECTION.of(gradients=True, sender=9, receiver=2) == "gradients down"
    # as the executor asks it: each send from one rank to another, and the receive at the other end
    for send, recv, group in ((Kind.SEND_F, Kind.RECV_F, "activations"), (Kind.SEND_B, Kind.RECV_B, "gradients")):
        for sender, receiver in ((3, 5), (5, 3)):
            direction = "up" if receiver > sender else "down"
            assert BY_DIRECTION.for_action(send, rank=sender, peer=receiver) == f"{group} {direction}"
            assert BY_DIRECTION.for_action(recv, rank=receiver, peer=sender) == f"{group} {direction}"


CASES = [(kind, ranks, microbatches)
         for kind in ("gpipe", "1f1b", "zb-h1", "interleaved", "zbv")
         for ranks in range(2, 7)
         for microbatches in ((2 * ranks - 1, 2 * ranks, 3 * ranks) if kind == "zbv" else (ranks, 2 * ranks, 3 * ranks))]


@pytest.mark.parametrize(("kind", "ranks", "microbatches"), CASES)
def test_no_generated_schedule_hangs_on_nccl_s_streams(kind, ranks, microbatches):
    chunks = 2 if kind in ("interleaved", "zbv") else 1
    assert _stuck_on_nccl(*_lowered(kind, ranks, microbatches, chunks), BY_DIRECTION) == []


def test_the_model_hangs_a_v_shape_whose_activations_cross_on_one_stream():
    # the runtime's two groups before (activations, gradients): a zbv rank sends its neighbour the
    # activations of one chunk before it receives those of the other, and so does the neighbour
    assert _stuck_on_nccl(*_lowered("zbv", 2, 4, 2), BY_KIND) != []
    assert _stuck_on_nccl(*_lowered("interleaved", 2, 4, 2), BY_KIND) != []
    assert _stuck_on_nccl(*_lowered("1f1b", 4, 8, 1), BY_KIND) == []


CROSSING = {0: [Action.parse(a) for a in ("0F0", "0SEND_F0", "0RECV_B0", "0B0")],
            1: [Action.parse(a) for a in ("1SEND_B0", "1RECV_F0")]}


def test_the_model_hangs_hosts_that_first_use_two_groups_in_crossing_orders():
    # rank 0 first sends an activation (activations up), rank 1 first sends a gradient (gradients
    # down): each host waits for the other to make the communicator it needs first
    assert _stuck_on_nccl(CROSSING, (0, 1), BY_DIRECTION) == [
        "rank 0's host making ('activations up', 0, 1)", "rank 1's host making ('gradients down', 0, 1)"]


def test_channels_opened_in_one_order_first_cannot_cross():
    # the crossing order above, and generated ones, once each rank has opened its channels as the
    # executor does before its first step
    assert _stuck_on_nccl(CROSSING, (0, 1), BY_DIRECTION, connected=True) == []
    for kind, ranks, microbatches in CASES[::7]:
        chunks = 2 if kind in ("interleaved", "zbv") else 1
        assert _stuck_on_nccl(*_lowered(kind, ranks, microbatches, chunks), BY_DIRECTION, connected=True) == []
    assert Channels.connections({(Kind.SEND_B, 1), (Kind.RECV_F, 1), (Kind.RECV_B, 5), (Kind.SEND_F, 5)}, 3) == [
        (0, 1, 3), (0, 3, 5), (3, 1, 3), (3, 3, 5)]  # activations up from 1 and to 5; gradients down to 1, from 5


def test_an_executor_given_channels_needs_its_global_rank():
    import torch

    from autopart.runtime.executor import Executor

    with pytest.raises(ValueError, match="global_rank"):
        Executor(rank=0, stages={}, last_stage=0, schedule={0: []}, microbatches=1, device=torch.device("cpu"),
                 channels=BY_DIRECTION)


def test_an_executor_opens_the_channels_of_its_messages_before_its_first_step():
    import torch
    from torch import nn

    from autopart.runtime.executor import Executor, StageRuntime

    opened = []

    class Recorded(Channels):
        def connect(self, messages, *, rank, device):
            opened.append((sorted(messages, key=lambda m: (m[0].value, m[1])), rank))

    schedule, _ = _lowered("1f1b", 3, 4, 1)
    middle = StageRuntime(index=1, module=nn.Identity(), inputs=[], batch_inputs=[], prev_rank=0, next_rank=2)
    executor = Executor(rank=1, stages={1: middle}, last_stage=2, schedule=schedule, microbatches=4,
                        device=torch.device("cpu"), channels=Recorded(*BY_DIRECTION.groups), global_rank=1)
    executor.connect()
    assert opened == [([(Kind.RECV_B, 2), (Kind.RECV_F, 0), (Kind.SEND_B, 0), (Kind.SEND_F, 2)], 1)]


def test_a_channel_that_cannot_be_opened_names_the_rank_the_channel_and_the_peer():
    import torch
    import torch.distributed as dist
    from torch import nn

    from autopart.runtime.executor import Executor, StageRuntime, StepFailure

    assert not dist.is_initialized()  # so the first send fails, as one to a peer that never came would
    schedule, _ = _lowered("1f1b", 2, 2, 1)
    first = StageRuntime(index=0, module=nn.Identity(), inputs=[], batch_inputs=[], prev_rank=None, next_rank=1)
    executor = Executor(rank=0, stages={0: first}, last_stage=1, schedule=schedule, microbatches=2,
                        device=torch.device("cpu"), channels=Channels(None, None, None, None), global_rank=0)
    with pytest.raises(StepFailure, match="rank 0, opening its pipeline channels before the first step: "
                                          "RuntimeError: the activations up channel from global rank 0 to 1: "):
        executor.connect()
