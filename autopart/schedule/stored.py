"""The schedule a plan stores: per rank, its compute actions as torch's action strings.

The plan holds the lists (``plan.schedule.actions``) and the runtime runs exactly them, so a
hand-edited list changes what runs; `plan_actions` reads them back and validates them before any
process starts (every forward and backward once on the rank that owns the stage, dependencies
in order, no deadlock, messages in order), with an error that names the rank and the position
in the list. The sends and receives are not stored: `add_communication` derives them from the
compute order, and storing them would only give a hand edit more ways to disagree with itself.

A plan written before the lists were stored runs its kind's generated order: that is exactly
what such a plan ran when it was written, so its checkpoints and results stay valid; the caller
says so in a note.

Lists equal to their kind's generated order (every plan autopart writes, until someone edits
it) are built, lowered and validated once per shape in a process (`generated`): a compile reads
its plan's schedule several times (its step, its timeline, its schedule.csv), and at a thousand
microbatches over a hundred ranks each validation takes seconds. A compile begins that
validation in a forked process as soon as it knows its plan's shape (`validation_beside`), and
`generated` waits for it where it would have validated: the plan's capture and prediction, on
the other core, take as long.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from autopart.ir.errors import ScheduleError
from autopart.ir.forked import Forked, may_fork
from autopart.ir.actions import Action, Schedule
from autopart.schedule.generators import SPLIT_BACKWARD_KINDS, build_schedule, stage_placement
from autopart.schedule.lowering import add_communication
from autopart.schedule.validate import check_message_order, validate

__all__ = ["Generated", "action_lists", "built", "built_lowered", "generated", "plan_actions", "keep_actions", "validation_beside", "compute_actions",
           "worth_forking"]


def action_lists(schedule: Schedule) -> tuple[tuple[str, ...], ...]:
    """A compute-only schedule as the plan stores it: one tuple of action strings per rank."""
    return tuple(tuple(str(action) for action in schedule[rank]) for rank in range(len(schedule)))


@dataclass(frozen=True)
class Generated:
    """A kind's schedule for one shape, validated; shared between callers: read it, never change it."""

    lists: tuple[tuple[str, ...], ...]  # as a plan stores it
    compute: Schedule
    placement: tuple[int, ...]
    shape: tuple[str, int, int, int]  # kind, ranks, microbatches, chunks

    @functools.cached_property
    def lowered(self) -> Schedule:
        """With the sends and receives (`built_lowered`), made at the first ask and kept: a compile
        whose validation ran beside it and whose messages take no rank time does not ask (lowering
        a million actions adds two million); the runtime does."""
        return built_lowered(*self.shape)


@functools.lru_cache(maxsize=16)
def generated(kind: str, ranks: int, microbatches: int, chunks: int) -> Generated:
    """``kind``'s schedule for this shape, built and validated once in a process (or validated
    beside it, `validation_beside`, and waited for here); lowered where asked (`Generated.lowered`)."""
    shape = (kind, ranks, microbatches, chunks)
    if not _validated_beside(_beside.pop(shape, None)):
        _check_generated(*shape)
    _validated.add(shape)
    return _made(*shape)


def _made(kind: str, ranks: int, microbatches: int, chunks: int) -> Generated:
    """``kind``'s schedule for this shape as its generator builds it, not validated (`generated` is)."""
    compute, placement = built(kind, ranks, microbatches, chunks)
    return Generated(lists=action_lists(compute), compute=compute, placement=placement,
                     shape=(kind, ranks, microbatches, chunks))


def _validated_beside(beside: Forked | None) -> bool:
    """Whether ``beside``, this process's validation, found the schedule valid (its ScheduleError
    raised); False where there is none (a forked copy's is its parent's to wait for) or its
    process failed (killed, out of memory): the caller validates it then."""
    if beside is None or beside.owner != os.getpid():
        return False
    try:
        beside.wait()
    except RuntimeError:
        return False
    return True


def _check_generated(kind: str, ranks: int, microbatches: int, chunks: int) -> None:
    compute, placement = built(kind, ranks, microbatches, chunks)
    shape = {"ranks": ranks, "stages": len(placement), "microbatches": microbatches, "placement": placement}
    _checked(compute, shape)  # every forward and backward once, in order, without a deadlock
    # Lowering puts each receive right before the compute it feeds and each send right after its
    # producer, pairing every message (`add_communication`): validated with its compute order, a
    # lowered schedule has only its messages' order on each channel left to check
    _checked(built_lowered(kind, ranks, microbatches, chunks), shape, messages_only=True)


FORK_FROM_ACTIONS = 20_000
"""Compute actions from which work over a schedule (its validation, `validation_beside`; its
report, ``autopart.codegen.report``) is forked beside the compile: over a smaller one it takes a
fraction of a second, less than forking a large compile costs."""

# Per process: the validations running beside it (`generated` takes each, or the block that began
# it stops it as it ends), and the shapes `generated` validated (nothing to begin for them again)
_beside: dict[tuple[str, int, int, int], Forked] = {}
_validated: set[tuple[str, int, int, int]] = set()


def compute_actions(kind: str, ranks: int, microbatches: int, chunks: int) -> int:
    """How many compute actions ``kind``'s schedule of this shape holds: a forward and a backward
    per stage and microbatch, and a weight gradient apart where the kind splits the backward."""
    return (3 if kind in SPLIT_BACKWARD_KINDS else 2) * ranks * chunks * microbatches


def worth_forking(kind: str, ranks: int, microbatches: int, chunks: int) -> bool:
    """Whether work over ``kind``'s schedule of this shape pays for forking: `FORK_FROM_ACTIONS`."""
    return compute_actions(kind, ranks, microbatches, chunks) >= FORK_FROM_ACTIONS


@contextlib.contextmanager
def validation_beside(kind: str, ranks: int, microbatches: int, chunks: int, *, fork: bool = True) -> Iterator[None]:
    """Within the block, ``kind``'s schedule of this shape validated in a forked process, for
    `generated` to wait for instead of validating it then: a compile opens the block as soon as
    it knows its plan's shape, and captures and predicts meanwhile (a schedule of a million
    actions takes seconds to validate). Nothing begun where the shape is small, validated or
    being validated already, ``fork`` is False (a compile that times this machine: a busy
    process beside it would be counted in what it measures) or the fork fails (`generated`
    validates it then). What the block did not take is stopped as it ends."""
    shape = (kind, ranks, microbatches, chunks)
    begun = False
    if fork and worth_forking(*shape) and shape not in _validated \
            and shape not in _beside and may_fork():
        try:
            _beside[shape] = Forked(functools.partial(_check_generated, *shape),
                                    what=f"validating the {kind} schedule of {ranks} ranks and {microbatches} microbatches")
            begun = True
        except OSError:  # no room to fork: validated where it is taken
            pass
    try:
        yield
    finally:
        left = _beside.pop(shape, None) if begun else None
        if left is not None:
            left.stop()


@functools.lru_cache(maxsize=16)
def built(kind: str, ranks: int, microbatches: int, chunks: int) -> tuple[Schedule, tuple[int, ...]]:
    """(compute, placement): ``kind``'s schedule for this shape as its generator builds it, not
    validated, for the step model to simulate: the search times candidates whose schedules
    nothing runs, and validating one of a thousand microbatches over a hundred ranks takes
    seconds. A plan's own lists go through `generated` (`plan_actions`), validated. Shared: read it."""
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    return build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks), placement


@functools.lru_cache(maxsize=16)
def built_lowered(kind: str, ranks: int, microbatches: int, chunks: int) -> Schedule:
    """`built`'s compute order with its sends and receives (`add_communication`), not validated;
    lowered apart from `built` because most simulations need only the compute order (messages
    that take no rank time change no time: `autopart.schedule.simulate`). Shared: read it."""
    compute, placement = built(kind, ranks, microbatches, chunks)
    return add_communication(compute, ranks=ranks, placement=placement)


def plan_actions(plan: Any, *, lowered: bool = True, compiled: bool = False) -> Schedule:
    """The schedule ``plan`` runs: its stored lists, validated (lowered: with the sends and
    receives added). Raises ScheduleError, one line naming the rank and position, for a bad list.
    Read it, never change it: an unedited plan's is shared (`generated`).

    ``compiled``: the plan is as a compile wrote it but for its lists (train.py, past its launch
    checks), and that compile validated the lists it wrote: lists equal to its kind's generated
    order are run as they are, where every rank validating them again took seconds at a million
    actions; any others (an edit) are validated all the same."""
    spec, ranks = plan.schedule, plan.mesh["pp"]
    placement = tuple(stage.rank for stage in plan.stages)
    shape = (spec.kind, ranks, spec.microbatches, spec.chunks)
    kinds = _made(*shape) if compiled and spec.actions else generated(*shape)
    if placement == kinds.placement and (not spec.actions or tuple(map(tuple, spec.actions)) == kinds.lists):
        return kinds.lowered if lowered else kinds.compute
    if not spec.actions:
        compute = build_schedule(spec.kind, ranks=ranks, microbatches=spec.microbatches, chunks=spec.chunks)
    else:
        compute = _parse(spec.actions, ranks)
    shape = {"ranks": ranks, "stages": len(plan.stages), "microbatches": spec.microbatches, "placement": placement}
    _checked(compute, shape)
    with_messages = add_communication(compute, ranks=ranks, placement=placement)
    _checked(with_messages, shape)  # the messages in order on every channel
    return with_messages if lowered else compute


def _checked(schedule: Schedule, shape: dict[str, Any], *, messages_only: bool = False) -> None:
    """`validate` (or, ``messages_only``, `check_message_order`), its error naming the position in
    the stored list (a receive: of the action it feeds)."""
    try:
        if messages_only:
            check_message_order(schedule, ranks=shape["ranks"], placement=shape["placement"])
        else:
            validate(schedule, **shape)
    except ScheduleError as exc:
        message = str(exc)
        if getattr(exc, "at", None) is not None:
            rank, step = exc.at  # type: ignore[attr-defined]
            position = sum(1 for action in schedule[rank][:step] if action.is_compute)
            message = message.replace(f"rank {rank}, step {step}:", f"rank {rank}, position {position}:", 1)
        raise ScheduleError(f"plan.schedule.actions: {message}") from None


def keep_actions(rebuilt: Any, pinned: Any) -> Any:
    """``rebuilt`` (a plan rebuilt from ``pinned``'s cuts and options, for ``--plan``) with the
    pinned plan's action lists, validated: a hand-edited order survives a recompile."""
    if not pinned.schedule.actions:
        return rebuilt
    plan = replace(rebuilt, schedule=replace(rebuilt.schedule, actions=pinned.schedule.actions))
    plan_actions(plan, lowered=False)  # an edited order is lowered and checked whole all the same
    return plan


def _parse(lists: tuple[tuple[str, ...], ...], ranks: int) -> Schedule:
    if len(lists) != ranks:
        raise ScheduleError(
            f"plan.schedule.actions has {len(lists)} lists but the pipeline has {ranks} ranks; give one list per rank"
        )
    schedule: Schedule = {}
    for rank, texts in enumerate(lists):
        actions = []
        for position, text in enumerate(texts):
            try:
                action = Action.parse(text)
            except ScheduleError as exc:
                raise ScheduleError(f"plan.schedule.actions: rank {rank}, position {position}: {exc}") from None
            if not action.is_compute:
                raise ScheduleError(
                    f"plan.schedule.actions: rank {rank}, position {position}: {action} is a message; the lists hold "
                    "F, B, I and W only (the sends and receives are added from them)"
                )
            actions.append(action)
        schedule[rank] = actions
    return schedule
