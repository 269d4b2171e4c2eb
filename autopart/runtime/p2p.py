"""Activations forward and gradients backward between pipeline stages.

Ordered ``isend``/``irecv`` pairs, one tensor at a time: messages between two ranks match in the
order they are posted (NCCL ignores tags), so every pair of ranks must send and receive in the
same order; `check_message_order` proves that of a schedule before the first step, which
matters once a rank holds several stages (interleaved) and one channel carries activations and
gradients of different stages. (gloo's ``batch_isend_irecv`` is no real batch and is known to
hang.) Sends are asynchronous and waited for at the end of the step; receives are waited for
before the action that consumes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.ir.tensors import TensorMeta
from autopart.ir.errors import ScheduleError
from autopart.schedule import Kind, Schedule, stage_rank

__all__ = ["send_tensors", "recv_tensors", "check_message_order"]

_Message = tuple[str, int, int]  # ("F" or "B", the boundary's lower stage, microbatch)


def check_message_order(schedule: Schedule, *, ranks: int) -> None:
    """Raise ScheduleError unless, for every pair of ranks, the receiver's RECVs come in the
    order of the sender's SENDs: otherwise a message would land in the wrong buffer."""
    sent: dict[tuple[int, int], list[_Message]] = {}
    received: dict[tuple[int, int], list[_Message]] = {}
    for rank, actions in schedule.items():
        for action in actions:
            s, m = action.stage, action.microbatch
            if action.kind is Kind.SEND_F:
                sent.setdefault((rank, stage_rank(s + 1, ranks)), []).append(("F", s, m))
            elif action.kind is Kind.SEND_B:
                sent.setdefault((rank, stage_rank(s - 1, ranks)), []).append(("B", s - 1, m))
            elif action.kind is Kind.RECV_F:
                received.setdefault((stage_rank(s - 1, ranks), rank), []).append(("F", s - 1, m))
            elif action.kind is Kind.RECV_B:
                received.setdefault((stage_rank(s + 1, ranks), rank), []).append(("B", s, m))
    for channel in sorted(set(sent) | set(received)):
        sends, receives = sent.get(channel, []), received.get(channel, [])
        if sends != receives:
            first = next((i for i, (a, b) in enumerate(zip(sends, receives)) if a != b), min(len(sends), len(receives)))
            raise ScheduleError(
                f"rank {channel[0]} sends to rank {channel[1]} in another order than rank {channel[1]} receives: "
                f"message {first} is {_describe(sends, first)} on the sender, {_describe(receives, first)} on the "
                "receiver; reorder the schedule's sends or receives to match"
            )


def _describe(messages: list[_Message], index: int) -> str:
    if index >= len(messages):
        return "missing"
    direction, stage, microbatch = messages[index]
    arrow = f"{stage}->{stage + 1}" if direction == "F" else f"{stage + 1}->{stage}"
    return f"the {'activation' if direction == 'F' else 'gradient'} {arrow} of microbatch {microbatch}"


def send_tensors(tensors: list[torch.Tensor], peer: int) -> list[dist.Work]:
    return [dist.isend(t.detach().contiguous(), peer) for t in tensors]


def recv_tensors(metas: list[TensorMeta], peer: int, device: torch.device) -> list[torch.Tensor]:
    buffers = [torch.empty(m.shape, dtype=getattr(torch, m.dtype), device=device) for m in metas]
    works = [dist.irecv(buffer, peer) for buffer in buffers]
    for work in works:
        work.wait()
    return buffers
