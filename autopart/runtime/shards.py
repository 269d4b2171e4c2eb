"""Slicing weights for tensor-parallel ranks, and putting the slices back together."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from autopart.ir.plan import Plan
from autopart.ir.placement import REPLICATE, Placement

__all__ = ["shard_weight", "unshard_weight", "load_stage_weights", "weights_file_name"]


def shard_weight(tensor: torch.Tensor, placement: Placement, tp: int, rank: int) -> torch.Tensor:
    """The slice of a parameter or buffer that TP rank ``rank`` holds (each group's r-th block);
    it may share storage with ``tensor`` (every caller copies it into a tensor of its own)."""
    if placement.kind != "S":
        return tensor
    pieces = [g.chunk(tp, placement.dim)[rank] for g in tensor.chunk(placement.groups, placement.dim)]
    # one group: the slice itself (a meta model's thousand-layer emit computes every shard's shape)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, placement.dim)).contiguous()


def unshard_weight(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The whole tensor from every TP rank's slice (the inverse of ``shard_weight``)."""
    if placement.kind != "S":
        return pieces[0]
    per_rank = [piece.chunk(placement.groups, placement.dim) for piece in pieces]
    return torch.cat([per_rank[r][g] for g in range(placement.groups) for r in range(len(pieces))], placement.dim)


def load_stage_weights(plan: Plan, folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Per stage, its whole tensors under their original names, from a folder of per-rank files."""
    tp = plan.mesh["tp"]
    stages = {}
    for stage in plan.stages:
        files = [Path(folder) / weights_file_name(stage.index, r, tp) for r in range(tp)]
        if not files[0].is_file():  # a meta model's stage made on its rank: nothing written
            stages[stage.index] = {}
            continue
        pieces = [load_file(str(f)) for f in files]
        placements = {name: Placement.parse(p) for name, p in stage.parameter_placements.items()}
        stages[stage.index] = {
            name: unshard_weight([piece[name] for piece in pieces], placements.get(name, REPLICATE))
            for name in pieces[0]
        }
    return stages


def weights_file_name(stage: int, tp_rank: int, tp: int) -> str:
    """``stage_<k>.safetensors``, or ``stage_<k>.tp<r>.safetensors`` for each tensor-parallel rank."""
    return f"stage_{stage}.safetensors" if tp == 1 else f"stage_{stage}.tp{tp_rank}.safetensors"
