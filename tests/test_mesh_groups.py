"""The mesh's process groups: each axis's members, and train.py's --timeout on every one of them
(torch's ``init_device_mesh`` gave them torch's default, 30 minutes on gloo)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from autopart.runtime.mesh import Mesh, group_of
from tests.distributed import gloo_group, spawn_ranks

TIMEOUT_S = 2.0


def _groups_and_a_stuck_peer(rank: int, port: int) -> None:
    mesh = Mesh(dp=2, pp=1, tp=2)
    with gloo_group(rank, port, mesh.size):
        device_mesh = mesh.device_mesh("cpu", datetime.timedelta(seconds=TIMEOUT_S))
        here = mesh.coordinates(rank)
        tp, dp = group_of(device_mesh, "tp"), group_of(device_mesh, "dp")
        assert dist.get_process_group_ranks(tp) == [mesh.rank(dp=here.dp, pp=0, tp=t) for t in range(2)]
        assert dist.get_process_group_ranks(dp) == [mesh.rank(dp=d, pp=0, tp=here.tp) for d in range(2)]
        assert group_of(device_mesh, "pp") is None and device_mesh["dp"].get_group() is dp
        value = torch.ones(1)
        dist.all_reduce(value, group=dp)
        assert value.item() == 2
        if rank == 0:  # rank 1, its tensor-parallel peer, never joins: the group's timeout ends the wait
            start = time.monotonic()
            with pytest.raises(RuntimeError):
                dist.all_reduce(torch.ones(1), group=tp)
            waited = time.monotonic() - start
            assert TIMEOUT_S * 0.9 <= waited < 60, f"waited {waited:.1f} s"
        elif rank in (2, 3):  # the other replica's group works as before
            value = torch.ones(1)
            dist.all_reduce(value, group=tp)
            assert value.item() == 2
        # rank 1 waits here, at the world group's barrier, until rank 0 has timed out


@pytest.mark.multiprocess
def test_mesh_groups_have_their_axes_ranks_and_the_given_timeout():
    assert spawn_ranks(_groups_and_a_stuck_peer, 4, timeout=120) == [0, 0, 0, 0]
