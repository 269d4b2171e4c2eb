"""ZB-V: the zero-bubble schedule with two model chunks per rank placed in a V.

Rank r holds chunk r and chunk 2p−1−r (`v_stage_rank`): the model runs down the ranks and back
up, so rank 0 holds both the first stage and the loss, and the turn at rank p−1 needs no
message. With the backward split into I (input gradients) and W (weight gradients), each rank
fills its warm-up and cool-down with W halves, which makes the bubble vanish when F, I and W
take equal time; at peak a rank holds the activations of about 2p microbatches of half-size
chunks, the same memory as 1F1B's p microbatches of whole stages (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR'24, section 6; arXiv 2401.10241).

The order is torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` (its
``_calculate_single_rank_operations``), written out here as action lists in the same format,
without the idle slots torch pads with (a rank's receives wait for its inputs anyway).
"""

from __future__ import annotations

from autopart.ir.errors import ConfigError
from autopart.ir.actions import Action, Kind, Schedule

__all__ = ["zbv_schedule", "check_zbv"]


def check_zbv(*, ranks: int, microbatches: int, chunks: int) -> None:
    """ConfigError unless the numbers fit ZB-V (two chunks per rank, enough microbatches)."""
    if chunks != 2:
        raise ConfigError(f"zbv runs exactly 2 model chunks per rank in a V (got {chunks}); use --chunks 2")
    if microbatches < 2 * ranks - 1:
        raise ConfigError(
            f"zbv needs at least 2 x pp - 1 = {2 * ranks - 1} microbatches to fill its V (got {microbatches}); "
            f"use --microbatches {2 * ranks}"
        )


def zbv_schedule(*, ranks: int, microbatches: int) -> Schedule:
    """The compute actions of every rank; stage s lives on `v_stage_rank` (s, ranks)."""
    return {rank: _rank_actions(rank, ranks=ranks, microbatches=microbatches) for rank in range(ranks)}


class _Counters:
    """What one rank has issued so far, per chunk: forwards, input and weight gradients."""

    def __init__(self, rank: int, ranks: int):
        self.stage = (rank, 2 * ranks - 1 - rank)
        self.f, self.i, self.w = [0, 0], [0, 0], [0, 0]
        self.out: list[Action] = []

    def forward(self, chunk: int) -> None:
        self.out.append(Action(self.stage[chunk], Kind.F, self.f[chunk]))
        self.f[chunk] += 1

    def input_grad(self, chunk: int) -> None:
        self.out.append(Action(self.stage[chunk], Kind.I, self.i[chunk]))
        self.i[chunk] += 1

    def weight_grad(self, chunk: int) -> None:
        self.out.append(Action(self.stage[chunk], Kind.W, self.w[chunk]))
        self.w[chunk] += 1


def _rank_actions(rank: int, *, ranks: int, microbatches: int) -> list[Action]:
    run = _Counters(rank, ranks)
    # Warm-up: chunk 0 fills the way down to the turn; from rank p-1 upwards the chunk-1
    # forwards come back, and each rank starts chunk 1's backward as soon as it can.
    for _ in range(2 * (ranks - rank) - 1):
        run.forward(0)
    for _ in range(rank):
        run.forward(1)
        run.forward(0)
    for _ in range(ranks - rank):
        run.forward(1)
        run.input_grad(1)
        run.weight_grad(1)
    # Steady state: one forward and one whole backward (I then W) of each chunk in turn.
    while run.f[1] < run.f[0] or run.f[0] < microbatches:
        if run.f[0] < microbatches:
            run.forward(0)
        run.input_grad(0)
        run.weight_grad(0)
        run.forward(1)
        run.input_grad(1)
        run.weight_grad(1)
    # Cool-down: the input gradients first, so the ranks below get theirs; the weight halves,
    # which nobody waits for, fill the gaps and the end.
    for _ in range(rank):
        run.input_grad(0)
        run.input_grad(1)
    for _ in range(ranks - rank):
        run.input_grad(0)
        run.weight_grad(0)
    while run.w[1] < run.i[1]:
        run.weight_grad(1)
    while run.w[0] < run.i[0]:
        run.weight_grad(0)
    return run.out
