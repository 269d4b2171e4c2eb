"""The vocabulary of pipeline schedules: one step of one rank is an `Action`.

A schedule is plain data, ``dict[rank, list[Action]]``, so that the generator, the lowering
pass, the validator, the simulator, the trace writer and the runtime executor all read one
definition of what a schedule means. Actions print as ``1F0`` (stage 1, forward, microbatch 0)
or ``0SEND_F3``: the same strings as ``torch.distributed.pipelining``'s ``_Action``, so a schedule
can be handed to torch's tooling, and a schedule dumped by torch can be read here.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from autopart.ir.errors import ScheduleError

__all__ = [
    "Kind", "Action", "Schedule", "stage_rank", "v_stage_rank", "rank_of", "COMPUTE_KINDS", "COMM_KINDS",
    "RECEIVE_KINDS", "PARTNER_KIND",
]


class Kind(enum.Enum):
    """What an action does. The values are torch's ``_ComputationType`` strings."""

    F = "F"
    """Forward of one microbatch through one stage."""
    B = "B"
    """Full backward: input and weight gradients together."""
    I = "I"  # noqa: E741 - the zero-bubble paper's and torch's name
    """Input-gradient half of the backward (zero-bubble schedules); frees the activations."""
    W = "W"
    """Weight-gradient half of the backward; can be deferred to fill bubbles."""
    SEND_F = "SEND_F"
    """Send a stage's output activation to the next stage (on another rank)."""
    RECV_F = "RECV_F"
    """Receive a stage's input activation from the previous stage (on another rank)."""
    SEND_B = "SEND_B"
    """Send the gradient of a stage's input to the previous stage (on another rank)."""
    RECV_B = "RECV_B"
    """Receive the gradient of a stage's output from the next stage (on another rank)."""

    @property
    def is_compute(self) -> bool:
        """True for the kinds that occupy the rank (F, B, I, W)."""
        return self in COMPUTE_KINDS

    # members are singletons and compare by identity, so identity's hash (in C) serves: Enum's own
    # hashes the name in Python, and schedules key millions of (stage, kind, microbatch) tuples
    __hash__ = object.__hash__


COMPUTE_KINDS: frozenset[Kind] = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
"""Kinds that take compute time on their rank; generators emit only these."""

COMM_KINDS: frozenset[Kind] = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
"""Kinds that the lowering pass inserts between ranks."""

RECEIVE_KINDS: frozenset[Kind] = frozenset({Kind.RECV_F, Kind.RECV_B})
"""The communication kinds that wait for another rank's data."""

# Longest names first is not needed: every kind is followed by digits, and the anchors make the
# match unambiguous ("0SEND_F3" can only split one way).
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` on virtual ``stage``.

    For SEND_F and SEND_B ``stage`` is the sending stage; for RECV_F and RECV_B it is the
    receiving stage (torch's convention): ``0SEND_F3`` pairs with ``1RECV_F3``, and ``1SEND_B3``
    pairs with ``0RECV_B3``.
    """

    stage: int
    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(f"action kind must be a Kind, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(
                f"action {self.stage}{self.kind.value}{self.microbatch} has a negative index; "
                "stages and microbatches count from 0"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        """True when the action occupies its rank (F, B, I, W)."""
        return self.kind in COMPUTE_KINDS

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of a send or receive (-1 or past the last where a schedule
        is wrong)."""
        if self.kind not in PARTNER_KIND:
            raise ScheduleError(f"{self} is not a send or a receive; only messages have a peer")
        return self.stage + (1 if self.kind in (Kind.SEND_F, Kind.RECV_B) else -1)

    @property
    def partner(self) -> Action:
        """The other end of a message: the receive that takes a send's tensors, or the send that
        a receive waits for (``0SEND_F3`` <-> ``1RECV_F3``, ``1SEND_B3`` <-> ``0RECV_B3``)."""
        return Action(self.peer_stage, PARTNER_KIND[self.kind], self.microbatch)

    @staticmethod
    def parse(text: str) -> Action:
        """Read back what ``str(action)`` writes, e.g. ``"1F0"`` or ``"0SEND_F3"``.

        Surrounding whitespace is ignored (CSV cells often carry it); anything else that is not
        ``<stage><kind><microbatch>`` raises ScheduleError.
        """
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"malformed action {text!r}; write <stage><kind><microbatch> with kind one of "
                f"{', '.join(k.value for k in Kind)}, e.g. '1F0' or '0SEND_F3'"
            )
        stage, kind, microbatch = match.groups()
        return Action(int(stage), Kind(kind), int(microbatch))


PARTNER_KIND: dict[Kind, Kind] = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F, Kind.SEND_B: Kind.RECV_B, Kind.RECV_B: Kind.SEND_B}

Schedule = dict[int, list[Action]]
"""Rank -> that rank's actions, in the order the rank runs them."""


def stage_rank(stage: int, ranks: int) -> int:
    """The rank that holds virtual ``stage`` under loop placement.

    Rank r holds stages r, r + ranks, r + 2·ranks, ...: with one chunk per rank stage s is on
    rank s, and with interleaving each rank holds one chunk from every round of the loop, which
    is what makes the interleaved schedule's bubble shrink by the number of chunks.
    """
    if ranks < 1:
        raise ScheduleError(f"a pipeline needs at least one rank, got ranks={ranks}")
    if stage < 0:
        raise ScheduleError(f"stages count from 0, got stage={stage}")
    return stage % ranks


def v_stage_rank(stage: int, ranks: int) -> int:
    """The rank that holds ``stage`` of a V-shape schedule (ZB-V): two chunks per rank, rank r
    holding stages r and 2·ranks−1−r. The model goes down the ranks and comes back up, so the
    first stage and the last (the loss) sit on rank 0, and the turn at rank ranks−1 hands its
    tensors over in memory (torch's ``generate_stage_to_rank_mapping(style="v")``)."""
    if ranks < 1:
        raise ScheduleError(f"a pipeline needs at least one rank, got ranks={ranks}")
    if not 0 <= stage < 2 * ranks:
        raise ScheduleError(f"a V over {ranks} ranks has stages 0 to {2 * ranks - 1}, got stage={stage}")
    return stage if stage < ranks else 2 * ranks - 1 - stage


def rank_of(stage: int, ranks: int, placement: Sequence[int] | None = None) -> int:
    """The rank of ``stage``: ``placement[stage]`` where the schedule places its stages itself
    (`v_stage_rank` for zbv; a plan's stage ranks), the loop of `stage_rank` without one."""
    if placement is None:
        return stage_rank(stage, ranks)
    if not 0 <= stage < len(placement):
        raise ScheduleError(f"stage {stage} is not placed: the placement has stages 0 to {len(placement) - 1}")
    return placement[stage]

