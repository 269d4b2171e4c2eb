"""Generate the compute order of each rank for the pipeline schedules autopart supports.

All four schedules are one loop with different knobs, as in torch's ``_get_1f1b_rank_ops``:
a rank runs ``warmup`` forwards, then alternates one forward with one backward, then runs the
remaining backwards. GPipe is the case where the warmup covers every forward; 1F1B warms up
just enough to fill the pipeline (p−1−r forwards on rank r), which caps the activations a stage
keeps; interleaved 1F1B walks the rank's model chunks in rounds of p microbatches; ZB-H1 is 1F1B
with the backward split into I and W and rank r deferring r weight-gradient halves into the
cooldown, where 1F1B leaves the rank idle.

The output holds compute actions only; `add_communication` inserts the sends and receives.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.ir.errors import ConfigError
from autopart.ir.actions import Action, Kind, Schedule, stage_rank, v_stage_rank
from autopart.schedule.vshape import check_zbv, zbv_schedule

__all__ = ["SCHEDULE_KINDS", "SPLIT_BACKWARD_KINDS", "build_schedule", "stage_placement"]

SCHEDULE_KINDS: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
"""The names accepted by `build_schedule` (and by ``--schedule``)."""

SPLIT_BACKWARD_KINDS: tuple[str, ...] = ("zb-h1", "zbv")
"""The zero-bubble schedules, whose backward is split into I (input gradients) and W (weights)."""

MOST_MICROBATCHES = 1 << 14
"""Microbatches a replica runs in one step, at most: each is an action of every stage in the
schedule that the compile lays out, validates and simulates, and writes into plan.json (a step of
a million of them took minutes to compile); published pipelines run a few hundred."""

_Work = tuple[int, int]  # (stage, microbatch)


@dataclass(frozen=True, kw_only=True)
class _RankPlan:
    """The knobs that turn the one loop into a particular schedule on one rank."""

    forwards: list[_Work]
    """(stage, microbatch) of every forward, in the order the rank runs them."""
    backwards: list[_Work]
    """(stage, microbatch) of every backward, in the order the rank runs them."""
    warmup: int
    """Forwards run before the first backward."""
    split_backward: bool = False
    """Emit I and W instead of B (zero bubble)."""
    deferred_weights: int = 0
    """With a split backward: how many W halves lag behind their I (they run in the cooldown)."""


def build_schedule(kind: str, *, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The compute actions of every rank for schedule ``kind``.

    Stages are numbered 0 .. ranks·chunks−1 and placed by `stage_placement` (stage s on rank
    s % ranks, but in a V for zbv). Raises ConfigError when the numbers do not fit the schedule.
    """
    _check_config(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    if kind == "zbv":
        return zbv_schedule(ranks=ranks, microbatches=microbatches)
    return {
        rank: _rank_actions(
            _rank_plan(kind, rank, ranks=ranks, microbatches=microbatches, chunks=chunks)
        )
        for rank in range(ranks)
    }


def stage_placement(kind: str, *, ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """The rank of every stage under schedule ``kind``: the V for zbv, the loop otherwise."""
    place = v_stage_rank if kind == "zbv" else stage_rank
    return tuple(place(stage, ranks) for stage in range(ranks * chunks))


def _rank_plan(kind: str, rank: int, *, ranks: int, microbatches: int, chunks: int) -> _RankPlan:
    if kind == "gpipe":
        return _gpipe(rank, microbatches=microbatches)
    if kind == "1f1b":
        return _one_f_one_b(rank, ranks=ranks, microbatches=microbatches)
    if kind == "zb-h1":
        return _zb_h1(rank, ranks=ranks, microbatches=microbatches)
    assert kind == "interleaved", kind
    return _interleaved(rank, ranks=ranks, microbatches=microbatches, chunks=chunks)


def _check_config(kind: str, *, ranks: int, microbatches: int, chunks: int) -> None:
    if kind not in SCHEDULE_KINDS:
        raise ConfigError(
            f"unknown schedule {kind!r}; use --schedule with one of {', '.join(SCHEDULE_KINDS)}"
        )
    if ranks < 1:
        raise ConfigError(
            f"the pipeline degree must be at least 1 (got {ranks}); use --pp 1 or more"
        )
    if microbatches < 1:
        raise ConfigError(
            f"a pipeline needs at least one microbatch (got {microbatches}); "
            f"use --microbatches {ranks}"
        )
    if kind == "zbv":
        check_zbv(ranks=ranks, microbatches=microbatches, chunks=chunks)
    elif kind == "interleaved":
        if chunks < 2:
            raise ConfigError(
                f"interleaved needs at least 2 model chunks per rank (got {chunks}); "
                "use --chunks 2, or --schedule 1f1b for one chunk per rank"
            )
        if microbatches % ranks != 0:
            fix = -(-microbatches // ranks) * ranks
            raise ConfigError(
                f"interleaved needs microbatches ({microbatches}) to be a multiple of the "
                f"pipeline degree ({ranks}); use --microbatches {fix}"
            )
    elif chunks != 1:
        raise ConfigError(
            f"{kind} runs one model chunk per rank (got {chunks}); "
            f"use --chunks 1, or --schedule interleaved for {chunks} chunks per rank"
        )


def _gpipe(rank: int, *, microbatches: int) -> _RankPlan:
    # Every forward before any backward: simple, and every microbatch's activations stay alive.
    work = [(rank, mb) for mb in range(microbatches)]
    return _RankPlan(forwards=work, backwards=work, warmup=microbatches)


def _one_f_one_b(rank: int, *, ranks: int, microbatches: int) -> _RankPlan:
    # p−1−r forwards fill the pipeline up to this rank; afterwards each new forward waits for a
    # backward, so stage r never holds more than p−r microbatches.
    work = [(rank, mb) for mb in range(microbatches)]
    return _RankPlan(forwards=work, backwards=work, warmup=min(ranks - 1 - rank, microbatches))


def _zb_h1(rank: int, *, ranks: int, microbatches: int) -> _RankPlan:
    # Same forwards and input-gradient order as 1F1B (so the same activation memory). In 1F1B
    # rank r runs out of work about r backwards before rank 0 finishes; holding back r W halves
    # fills that tail (Qi et al., ICLR'24, ZB-H1; torch's ScheduleInterleavedZeroBubble with one
    # chunk).
    work = [(rank, mb) for mb in range(microbatches)]
    return _RankPlan(
        forwards=work,
        backwards=work,
        warmup=min(ranks - 1 - rank, microbatches),
        split_backward=True,
        deferred_weights=rank,
    )


def _interleaved(rank: int, *, ranks: int, microbatches: int, chunks: int) -> _RankPlan:
    # Megatron's order (Narayanan et al., SC21 §2.2.2; torch's ScheduleInterleaved1F1B): forwards
    # go in rounds of `ranks` microbatches through chunk 0, then the same round through chunk 1,
    # and so on; backwards walk the chunks in reverse. The warmup lets the last chunk's first
    # round reach the end of the pipeline, plus two steps per hop to the last rank for the
    # backward to come back.
    total = microbatches * chunks

    def work(op: int, *, backward: bool) -> _Work:
        chunk = (op // ranks) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        microbatch = (op // (ranks * chunks)) * ranks + op % ranks
        return (chunk * ranks + rank, microbatch)

    warmup = min((chunks - 1) * ranks + 2 * (ranks - 1 - rank), total)
    return _RankPlan(
        forwards=[work(op, backward=False) for op in range(total)],
        backwards=[work(op, backward=True) for op in range(total)],
        warmup=warmup,
    )


def _rank_actions(plan: _RankPlan) -> list[Action]:
    """Warmup forwards, then one forward and one backward at a time, then the rest."""
    backward_kind = Kind.I if plan.split_backward else Kind.B
    actions = [Action(stage, Kind.F, mb) for stage, mb in plan.forwards[: plan.warmup]]
    pending_forwards = plan.forwards[plan.warmup :]
    weights_done = 0
    for index, (stage, mb) in enumerate(plan.backwards):
        if index < len(pending_forwards):
            f_stage, f_mb = pending_forwards[index]
            actions.append(Action(f_stage, Kind.F, f_mb))
        actions.append(Action(stage, backward_kind, mb))
        if plan.split_backward and index >= plan.deferred_weights:
            w_stage, w_mb = plan.backwards[weights_done]
            actions.append(Action(w_stage, Kind.W, w_mb))
            weights_done += 1
    if plan.split_backward:
        actions.extend(Action(stage, Kind.W, mb) for stage, mb in plan.backwards[weights_done:])
    return actions
