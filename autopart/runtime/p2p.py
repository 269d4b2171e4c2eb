"""Activations forward and gradients backward between pipeline stages.

Ordered ``isend``/``irecv`` pairs, one tensor at a time: messages between two ranks match in the
order they are posted (NCCL ignores tags). Each kind of message and each direction has a process
group of its own (`Channels`): activations toward a higher global rank, toward a lower one, and
gradients alike. Without a ``device_id`` at ``init_process_group`` (as here) NCCL gives a group
one communicator, and so one stream, per pair of ranks that exchange messages over it (with one,
a stream per group for all its pairs), and a send of more than NCCL's buffers hold keeps that
stream until its peer's receive is posted: two ranks that each send on one stream before they
receive what the other sent there both wait. A V-shape schedule (zbv) sends activations both ways
between two ranks, and interleaving over two ranks does too; with a stream per direction each
carries its messages in the order they are received, which `autopart.schedule.check_message_order`
proves of a schedule when the plan is loaded. (gloo's ``batch_isend_irecv`` is no real batch and
is known to hang.) Sends are asynchronous and waited for at the end of the step; receives are
waited for before the action that consumes them.

With tensor parallelism, a message is split over the tensor-parallel group
(`autopart.ir.scatter_gather`): each rank sends its 1/t of a replicated tensor and the receivers
all-gather the parts; a sequence-parallel tensor is each rank's slice already, sent and kept as
it is. Every rank of a group runs the same action list, so the all-gathers of a receive meet in
the same order on all of them, between the stage's own collectives.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopart.ir.actions import Kind
from autopart.ir.scatter_gather import gathered, held_shape, parts
from autopart.ir.tensors import TensorMeta
from autopart.runtime.collectives import all_gathered

__all__ = ["Channels", "Scatter", "send_tensors", "recv_tensors"]


@dataclass(frozen=True)
class Scatter:
    """This rank's place in its tensor-parallel group, over which its messages are split."""

    group: dist.ProcessGroup
    rank: int
    size: int


@dataclass(frozen=True)
class Channels:
    """The process groups a pipeline's messages travel on, per kind and direction (the module's
    docstring says why); None is the default group. Every rank makes them (`made`), in one order."""

    activations_up: Any
    activations_down: Any
    gradients_up: Any
    gradients_down: Any

    @classmethod
    def made(cls, timeout: datetime.timedelta) -> Channels:
        """A new group per channel but the first, which is the default group: a collective call
        that every rank makes, in the same order."""
        return cls(None, *(dist.new_group(timeout=timeout) for _ in range(3)))

    @property
    def groups(self) -> tuple[Any, Any, Any, Any]:
        """The four groups, in the order `connect` opens them."""
        return self.activations_up, self.activations_down, self.gradients_up, self.gradients_down

    def of(self, *, gradients: bool, sender: int, receiver: int) -> Any:
        """The group of a message from global rank ``sender`` to ``receiver``: both ends name it alike."""
        return self.groups[_channel(gradients, sender, receiver)]

    def for_action(self, kind: Kind, *, rank: int, peer: int) -> Any:
        """The group of a send or receive ``kind`` that global rank ``rank`` posts to or from ``peer``."""
        return self.groups[_channel(*_message(kind, rank, peer))]

    @staticmethod
    def connections(messages: Iterable[tuple[Kind, int]], rank: int) -> list[tuple[int, int, int]]:
        """Each (channel, lower rank, higher rank) that global rank ``rank``'s messages ``(kind,
        peer)`` use once, in the one order every rank opens them (`connect`): by channel (as
        `groups` lists them), then by the pair's ranks."""
        return sorted({(_channel(*_message(kind, rank, peer)), min(rank, peer), max(rank, peer))
                       for kind, peer in messages})

    def connect(self, messages: Iterable[tuple[Kind, int]], *, rank: int, device: torch.device) -> None:
        """Open, before the first step, each channel and pair that ``messages`` use, every rank in
        the order of `connections`: one element from the channel's sender to its receiver.

        NCCL without a ``device_id`` makes a pair's communicator on a group at the pair's first
        message there, both hosts waiting for each other until it is made. Made as a step first
        needs them, two ranks whose first uses of two channels cross would each wait for the
        other for good (an edited order can do that; the generated ones do not). In one order
        they cannot: of the pairs not yet open, the first in that order is the next one of both
        its ranks. On gloo it costs one small message per pair."""
        probe = torch.zeros(1, device=device)
        for channel, low, high in self.connections(messages, rank):
            sender, receiver = (low, high) if channel % 2 == 0 else (high, low)  # up, down
            try:
                if rank == sender:
                    dist.send(probe, receiver, group=self.groups[channel])
                else:
                    dist.recv(probe, sender, group=self.groups[channel])
            except Exception as exc:
                raise RuntimeError(f"the {_CHANNEL_NAMES[channel]} channel from global rank {sender} to "
                                   f"{receiver}: {exc}") from exc


def _message(kind: Kind, rank: int, peer: int) -> tuple[bool, int, int]:
    """A send or receive ``kind`` that ``rank`` posts to or from ``peer``: (gradients, sender, receiver)."""
    sends = kind is Kind.SEND_F or kind is Kind.SEND_B
    return kind is Kind.SEND_B or kind is Kind.RECV_B, rank if sends else peer, peer if sends else rank


_CHANNEL_NAMES = ("activations up", "activations down", "gradients up", "gradients down")  # as `Channels.groups`


def _channel(gradients: bool, sender: int, receiver: int) -> int:
    """A message's channel, its index in `Channels.groups`: by kind, then direction."""
    return 2 * gradients + (0 if receiver > sender else 1)


def send_tensors(tensors: list[torch.Tensor], peer: int, scatter: Scatter | None = None,
                 group: dist.ProcessGroup | None = None, *, metas: list[TensorMeta] | None = None) -> list[dist.Work]:
    """Post the sends of ``tensors``, which the plan describes as ``metas`` (None: all replicated);
    ``group`` (one of `Channels`) spans every rank, so ``peer`` is a global rank there too."""
    metas = metas if metas is not None else [None] * len(tensors)
    return [dist.isend(_part(t.detach(), m, scatter), peer, group=group) for t, m in zip(tensors, metas, strict=True)]


def recv_tensors(
    metas: list[TensorMeta], peer: int, device: torch.device, scatter: Scatter | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    tp = scatter.size if scatter else 1
    shapes = [(held_shape(m, tp), parts(m.numel, tp) if gathered(m, tp) else 1) for m in metas]
    buffers = [torch.empty(math.prod(shape) // n, dtype=getattr(torch, m.dtype), device=device)
               for m, (shape, n) in zip(metas, shapes)]
    works = [dist.irecv(buffer, peer, group=group) for buffer in buffers]
    for work in works:
        work.wait()
    return [_gathered(b, shape, n, scatter) for b, (shape, n) in zip(buffers, shapes)]


def _part(tensor: torch.Tensor, meta: TensorMeta | None, scatter: Scatter | None) -> torch.Tensor:
    """The share of ``tensor`` this rank sends: its 1/t where a replicated tensor splits, else all
    of what it holds (a sequence-parallel slice is its share already)."""
    held_whole = scatter is None or (meta is not None and not gathered(meta, scatter.size))
    if held_whole or parts(tensor.numel(), scatter.size) == 1:
        return tensor.contiguous()
    return tensor.contiguous().reshape(-1).chunk(scatter.size)[scatter.rank].contiguous()


def _gathered(buffer: torch.Tensor, shape: tuple[int, ...], split: int, scatter: Scatter | None) -> torch.Tensor:
    if split == 1:
        return buffer.view(shape)
    whole, _ = all_gathered(buffer.view(-1), split, group=scatter.group)
    return whole.view(shape)
