"""Which gradients a data-parallel rank all-reduces together, and when they are final: the rule
that the runtime's reducer (`autopart.runtime.reducer`) runs and the step model
(`autopart.predict.reduction`) counts, one definition of which bytes go when.

Buckets as DDP's: per stage in the order their gradients become final, each stage's parameters
from its last to its first (the backward's order), cut where a bucket reaches
`FIRST_BUCKET_BYTES` (the first; small, so that the reduction starts early) or `BUCKET_BYTES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.ir.actions import Action, Kind

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Bucket", "plan_buckets", "final_gradient_positions"]

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Gradients reduced in one all-reduce: parameters of one stage, in the order they become final."""

    stage: int
    names: tuple[str, ...]
    nbytes: int


def final_gradient_positions(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage, the position in a rank's action list of its last action that adds to the
    weight gradients (B, or W where the backward is split)."""
    final: dict[int, int] = {}
    B, W = Kind.B, Kind.W  # read once: an enum member's lookup cost more than the rest of the loop
    for position, action in enumerate(actions):
        kind = action.kind
        if kind is B or kind is W:
            final[action.stage] = position
    return final


def plan_buckets(stages: Sequence[tuple[int, Sequence[tuple[str, int]]]]) -> list[Bucket]:
    """The buckets of a rank. ``stages``: (stage, its parameters as (name, bytes) in forward
    order), in the order the stages' gradients become final."""
    buckets: list[Bucket] = []
    cap = FIRST_BUCKET_BYTES
    for stage, parameters in stages:
        names: list[str] = []
        filled = 0
        for name, nbytes in reversed(parameters):
            names.append(name)
            filled += nbytes
            if filled >= cap:
                buckets.append(Bucket(stage=stage, names=tuple(names), nbytes=filled))
                names, filled, cap = [], 0, BUCKET_BYTES
        if names:  # a bucket never spans two stages: their gradients become final at different times
            buckets.append(Bucket(stage=stage, names=tuple(names), nbytes=filled))
            cap = BUCKET_BYTES
    return buckets
