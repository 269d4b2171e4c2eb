"""Rank <-> (dp, pp, tp) coordinates, and the process groups of each axis.

Tensor parallelism is innermost, so that a tensor-parallel group is made of neighbouring ranks,
which torchrun places on the same node; then the pipeline; data parallelism outermost:

    rank = (dp_index * pp + pp_index) * tp + tp_index
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """The torch DeviceMesh over (dp, pp, tp); its groups are the axes' process groups."""
        return init_device_mesh(device_type, (self.dp, self.pp, self.tp), mesh_dim_names=("dp", "pp", "tp"))

    def pipeline_peers(self, rank: int, stage_rank_of_neighbour: int) -> int:
        """The rank that runs pipeline rank ``stage_rank_of_neighbour`` in this rank's (dp, tp) slice."""
        here = self.coordinates(rank)
        return self.rank(dp=here.dp, pp=stage_rank_of_neighbour, tp=here.tp)


def group_of(device_mesh: DeviceMesh, axis: str) -> dist.ProcessGroup | None:
    """The process group of ``axis``, or None when the axis has one rank."""
    return device_mesh.get_group(axis) if device_mesh.size(device_mesh.mesh_dim_names.index(axis)) > 1 else None
