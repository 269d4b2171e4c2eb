"""Where a tensor lives on a tensor-parallel group: replicated, partial, or sharded along a dim.

Shared by the sharding solver, the code generator and the runtime (which slices and reassembles
weights), so it depends on nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Placement", "REPLICATE", "PARTIAL", "shard"]


@dataclass(frozen=True, order=True)
class Placement:
    kind: str  # "R", "P" or "S"
    dim: int = 0
    groups: int = 1

    def __str__(self) -> str:
        if self.kind != "S":
            return self.kind
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim},{self.groups})"

    @staticmethod
    def parse(text: str) -> Placement:
        if text in ("R", "P"):
            return Placement(text)
        match = re.fullmatch(r"S\((\d+)(?:,(\d+))?\)", text)
        if not match:
            raise ValueError(f"not a placement: {text!r}")
        return Placement("S", int(match.group(1)), int(match.group(2) or 1))


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def shard(dim: int, groups: int = 1) -> Placement:
    return Placement("S", dim, groups)
