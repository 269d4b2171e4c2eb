"""Rank <-> (dp, pp, tp) coordinates, and the process groups of each axis.

Tensor parallelism is innermost, so that a tensor-parallel group is made of neighbouring ranks,
which torchrun places on the same node; then the pipeline; data parallelism outermost:

    rank = (dp_index * pp + pp_index) * tp + tp_index
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Coordinates", "Mesh"]


@dataclass(frozen=True)
class Coordinates:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Mesh:
    dp: int
    pp: int
    tp: int

    @staticmethod
    def of(plan) -> "Mesh":
        """The mesh a plan's ``mesh`` field describes."""
        return Mesh(dp=plan.mesh["dp"], pp=plan.mesh["pp"], tp=plan.mesh["tp"])

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def coordinates(self, rank: int) -> Coordinates:
        return Coordinates(dp=rank // (self.pp * self.tp), pp=rank // self.tp % self.pp, tp=rank % self.tp)

    def rank(self, *, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def device_mesh(self, device_type: str, timeout: datetime.timedelta | None = None) -> DeviceMesh:
        """The torch DeviceMesh over (dp, pp, tp); its groups are the axes' process groups, made
        here with ``timeout`` (None: torch's default for a new group). Every rank must call it.

        torch's ``init_device_mesh`` makes its groups with torch's default timeout whatever the
        world group's (10 minutes on NCCL, 30 on gloo; a timeout reaches them only through
        ``backend_override``, from torch 2.6), so a tensor- or data-parallel peer that stops
        would be found that late, not after train.py's ``--timeout``. An axis that spans the
        world is the world group, as in ``init_device_mesh``: no second communicator for it."""
        ranks = torch.arange(self.size).view(self.dp, self.pp, self.tp)
        groups = [_axis_group(ranks, axis, timeout) for axis in range(ranks.dim())]
        return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=("dp", "pp", "tp"))

    def pipeline_peers(self, rank: int, stage_rank_of_neighbour: int) -> int:
        """The rank that runs pipeline rank ``stage_rank_of_neighbour`` in this rank's (dp, tp) slice."""
        here = self.coordinates(rank)
        return self.rank(dp=here.dp, pp=stage_rank_of_neighbour, tp=here.tp)


def _axis_group(ranks: torch.Tensor, axis: int, timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """This rank's group along ``axis`` of the mesh ``ranks``. Every rank makes every group of the
    axis, in the same order (``new_group``'s contract), and keeps its own."""
    size = ranks.shape[axis]
    if size == dist.get_world_size():
        return dist.group.WORLD
    rank, mine = dist.get_rank(), None
    for members in ranks.movedim(axis, -1).reshape(-1, size).tolist():
        group = dist.new_group(members, timeout=timeout)
        if rank in members:
            mine = group
    assert mine is not None, f"rank {rank} is not in a mesh of {ranks.numel()} ranks"
    return mine


def group_of(device_mesh: DeviceMesh, axis: str) -> dist.ProcessGroup | None:
    """The process group of ``axis``, or None when the axis has one rank."""
    return device_mesh.get_group(axis) if device_mesh.size(device_mesh.mesh_dim_names.index(axis)) > 1 else None
