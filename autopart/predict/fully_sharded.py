"""What a ZeRO-3 stage's gathers and reduce-scatters add to its forward and backward, as FSDP2
overlaps them with the compute.

At level 3 each repeated layer a stage holds whole is a FSDP unit of its own and the stage
module is the root unit holding the rest (`autopart.runtime.fully_sharded`). FSDP2 gathers a
unit's weights just before it computes and frees them after; the collectives run on streams of
their own. In the forward the next unit's all-gather is issued as soon as the current unit's
kernels are queued, so it runs beside that unit's compute; in the backward FSDP2 prefetches the
next unit's all-gather explicitly, one unit ahead, and reduce-scatters each unit's gradients
once its backward ends, beside the next unit's backward. The data-parallel group's collectives
share its links, so they are taken one after another, in the order FSDP issues them: a unit's
prefetch at the start of the compute before it, its reduce-scatter at the end of its own.

What the compute then waits for is what this module counts: the first unit's gather, a
layer's transfers wherever they outlast the compute they run beside, and the compute's own
slowdown while they run (the collectives' kernels hold SMs: `slowing`). The reduce-scatters still
running when the backward ends are returned apart (``pending_s``): they run beside the stage's
next action, and the step waits for the last of them. Where the collectives do not run beside
the compute (gloo on a CPU computes and communicates on the same cores) each one adds whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["FullyShardedCost", "Piece", "added_beside", "fully_sharded_cost", "slowed", "slowing"]


@dataclass(frozen=True)
class Piece:
    """A stretch of a stage's compute in forward order: ``count`` equal layer units (each of
    ``unit_bytes``, this rank's fp32 parameter bytes of the layer, and of the seconds given) or,
    with ``unit_bytes`` 0, compute of the root unit (embedding, norms, head), whose weights are
    gathered once at the action's start."""

    forward_s: float
    backward_s: float
    unit_bytes: float = 0.0
    count: int = 1


def slowing(work_s: float, beside_s: float, slowdown: float) -> float:
    """How much longer compute of ``work_s`` seconds (alone) takes when collectives run beside it
    for its first ``beside_s`` seconds and slow it by ``slowdown`` meanwhile (the device's
    ``overlap_compute_slowdown``): it goes at 1 / (1 + slowdown) of its speed while they run."""
    if slowdown <= 0 or beside_s <= 0:
        return 0.0
    return min(beside_s, work_s * (1 + slowdown)) * slowdown / (1 + slowdown)


def slowed(work_s: float, beside_s: float, slowdown: float) -> float:
    """How long that compute takes (`slowing`)."""
    return work_s + slowing(work_s, beside_s, slowdown)


def added_beside(collective_s: float, action_s: float, slowdown: float) -> float:
    """What collectives of ``collective_s`` seconds, issued as an action of ``action_s`` seconds
    starts, add to it: what they run past it, which it waits for, or what they slow it by,
    which it takes longer (the larger of the two). ``action_s`` may be infinite."""
    return max(collective_s - action_s, slowing(action_s, collective_s, slowdown))


@dataclass(frozen=True)
class FullyShardedCost:
    forward_s: float  # what one forward waits for its gathers, and its slowdown beside them
    backward_s: float  # the same of one backward, with its (not overlapped) reduce-scatters
    pending_s: float  # reduce-scatters still running as the backward ends
    slowdown: float = 0.0  # the compute's, beside a collective

    def backward_beside(self, next_action_s: float) -> float:
        """What one backward adds once its pending reduce-scatters run beside the stage's next
        action, of ``next_action_s`` (in a pipeline's steady state a forward follows a backward):
        `added_beside`."""
        return self.backward_s + added_beside(self.pending_s, next_action_s, self.slowdown)


@dataclass(frozen=True)
class _Segment:
    compute_s: float
    gather_s: float = 0.0  # gathered before it computes
    reduce_s: float = 0.0  # reduce-scattered after it computes


def fully_sharded_cost(pieces: Sequence[Piece], root_bytes: float, *, gather_s: Callable[[float], float],
                       reduce_s: Callable[[float], float], overlapped: bool,
                       slowdown: float = 0.0) -> FullyShardedCost:
    """The gathers and reduce-scatters of a level-3 stage whose compute is ``pieces``, its root
    unit holding ``root_bytes``; ``gather_s`` and ``reduce_s`` give a collective's seconds for a
    unit's fp32 parameter bytes (the gather moves them in the compute dtype). ``slowdown``: the
    compute's while a collective runs beside it (`slowed`; ``overlapped`` only)."""
    gather = [gather_s(p.unit_bytes) if p.unit_bytes else 0.0 for p in pieces]
    reduce = [reduce_s(p.unit_bytes) if p.unit_bytes else 0.0 for p in pieces]
    root_gather, root_reduce = (gather_s(root_bytes), reduce_s(root_bytes)) if root_bytes else (0.0, 0.0)
    if not overlapped:
        gathers = root_gather + sum(p.count * g for p, g in zip(pieces, gather))
        reduces = root_reduce + sum(p.count * r for p, r in zip(pieces, reduce))
        return FullyShardedCost(forward_s=gathers, backward_s=gathers + reduces, pending_s=0.0)
    forward = [(_Segment(0.0, root_gather), 1)]
    forward += [(_Segment(p.forward_s, g), p.count) for p, g in zip(pieces, gather)]
    backward = [(_Segment(0.0, root_gather), 1)]
    backward += [(_Segment(p.backward_s, g, r), p.count)
                 for p, g, r in zip(reversed(pieces), reversed(gather), reversed(reduce))]
    backward.append((_Segment(0.0, 0.0, root_reduce), 1))
    forward_end, _ = _timeline(forward, slowdown)
    backward_end, channel_end = _timeline(backward, slowdown)
    return FullyShardedCost(forward_s=forward_end - sum(p.count * p.forward_s for p in pieces),
                            backward_s=backward_end - sum(p.count * p.backward_s for p in pieces),
                            pending_s=channel_end - backward_end, slowdown=slowdown)


def _timeline(segments: Sequence[tuple[_Segment, int]], slowdown: float) -> tuple[float, float]:
    """When the compute of ``segments`` (each repeated its count of times) ends and when the
    collectives' channel does, with each segment's gather issued at the start of the segment
    before it (the first at time 0) and its reduce-scatter at its end; a segment's compute is
    slowed by ``slowdown`` while the channel is busy beside it.

    A run of equal segments (a stage's identical layers) reaches a steady state in which every
    segment shifts the whole state (compute end, channel end, next gather's end) by the same
    seconds; the state is then advanced over the run at once. That is exact, not an
    approximation: the update is built of max, min and +, so shifting its input shifts its output."""
    runs: list[tuple[_Segment, int]] = []
    for segment, count in segments:  # equal neighbours make one run
        if runs and runs[-1][0] == segment:
            runs[-1] = (segment, runs[-1][1] + count)
        elif count:
            runs.append((segment, count))
    first = runs[0][0].gather_s if runs else 0.0
    compute, channel, ready = 0.0, first, first  # the first gather is issued at once
    for i, (segment, count) in enumerate(runs):
        following = runs[i + 1][0] if i + 1 < len(runs) else None
        done = 0
        while done < count:
            state = (compute, channel, ready)
            compute, channel, ready = _step(state, segment, segment if done + 1 < count else following,
                                             slowdown)
            done += 1
            shift = compute - state[0]
            if done + 1 < count and _same(channel - state[1], shift) and _same(ready - state[2], shift):
                skipped = count - 1 - done  # all but the run's last, whose successor differs
                compute, channel, ready = compute + skipped * shift, channel + skipped * shift, ready + skipped * shift
                done += skipped
    return compute, max(channel, compute)


def _step(state: tuple[float, float, float], segment: _Segment, following: _Segment | None,
          slowdown: float) -> tuple[float, float, float]:
    compute, channel, ready = state
    start = max(compute, ready)
    channel = max(channel, start)  # an idle channel waits for the compute's next issue
    if following is not None and following.gather_s:
        channel += following.gather_s  # the prefetch of the next segment's unit
        ready = channel
    else:
        ready = start
    compute = start + slowed(segment.compute_s, channel - start, slowdown)  # the links are busy until channel
    if segment.reduce_s:
        channel = max(channel, compute) + segment.reduce_s
    return compute, channel, ready


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
