"""The pipeline's messages on NCCL: a process group per kind and direction (`Channels`), so that
no generated schedule hangs on NCCL's streams, as a model of them shows.

The model is NCCL's point-to-point as torch drives it without a ``device_id`` (lazy communicators):
a group gives each pair of ranks one communicator and one stream, which runs its sends and
receives in the order they were posted; a send of more than NCCL's buffers hold ends together
with its receive, so it holds the stream until the receive is at the head of the peer's stream;
an operation starts only once the compute stream has run what was posted before it (torch makes
the NCCL stream wait on the current one); a receive's ``wait()`` holds the compute stream until
the receive has ended. Hosts never block. gloo, which the tests run on, holds none of this.
"""

from __future__ import annotations

import pytest

from autopart.ir.actions import Kind, rank_of
from autopart.runtime.p2p import Channels
from autopart.schedule import build_schedule, add_communication, stage_placement

BY_DIRECTION = Channels("activations up", "activations down", "gradients up", "gradients down")
BY_KIND = Channels("activations", "activations", "gradients", "gradients")  # two groups: the runtime before


def _stuck_on_nccl(kind: str, ranks: int, microbatches: int, chunks: int, channels: Channels) -> list[str]:
    """The operations left waiting when every stream has run what it can (none: the step ends)."""
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    schedule = add_communication(build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks),
                                 ranks=ranks, placement=placement)
    streams: dict[tuple, list[dict]] = {}  # (rank, "compute") or (rank, group, pair) -> its operations in order
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
            group = channels.of(gradients=action.kind in (Kind.SEND_B, Kind.RECV_B), sender=sender, receiver=receiver)
            side = "send" if sends else "recv"
            number = posted.get((group, sender, receiver, side), 0)
            posted[group, sender, receiver, side] = number + 1
            operation = {"what": f"{action} on {group!r}", "message": (group, sender, receiver, number), "side": side,
                         "after": len(compute)}  # what the compute stream had been given when it was posted
            streams.setdefault((rank, group, min(rank, peer), max(rank, peer)), []).append(operation)
            if not sends:
                compute.append({"what": f"wait for {action}", "waits": operation})
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


def test_both_ends_of_a_message_name_the_group_of_its_kind_and_direction():
    assert BY_DIRECTION.of(gradients=False, sender=3, receiver=5) == "activations up"
    assert BY_DIRECTION.of(gradients=False, sender=5, receiver=3) == "activations down"
    assert BY_DIRECTION.of(gradients=True, sender=2, receiver=9) == "gradients up"
    assert BY_DIRECTION.of(gradients=True, sender=9, receiver=2) == "gradients down"


CASES = [(kind, ranks, microbatches)
         for kind in ("gpipe", "1f1b", "zb-h1", "interleaved", "zbv")
         for ranks in range(2, 7)
         for microbatches in ((2 * ranks - 1, 2 * ranks, 3 * ranks) if kind == "zbv" else (ranks, 2 * ranks, 3 * ranks))]


@pytest.mark.parametrize(("kind", "ranks", "microbatches"), CASES)
def test_no_generated_schedule_hangs_on_nccl_s_streams(kind, ranks, microbatches):
    chunks = 2 if kind in ("interleaved", "zbv") else 1
    assert _stuck_on_nccl(kind, ranks, microbatches, chunks, BY_DIRECTION) == []


def test_the_model_hangs_a_v_shape_whose_activations_cross_on_one_stream():
    # the runtime's two groups before (activations, gradients): a zbv rank sends its neighbour the
    # activations of one chunk before it receives those of the other, and so does the neighbour
    assert _stuck_on_nccl("zbv", 2, 4, 2, BY_KIND) != []
    assert _stuck_on_nccl("interleaved", 2, 4, 2, BY_KIND) != []
    assert _stuck_on_nccl("1f1b", 4, 8, 1, BY_KIND) == []
