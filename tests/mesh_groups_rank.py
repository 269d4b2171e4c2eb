"""One rank of tests/test_mesh_groups.py: the mesh's groups have their axes' ranks, and a
tensor-parallel peer that never joins ends its partner's collective after the mesh's timeout."""

import datetime
import time

import torch
import torch.distributed as dist

from autopart.runtime.mesh import Mesh, group_of

TIMEOUT_S = 2.0

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = Mesh(dp=2, pp=1, tp=2)
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
    try:
        dist.all_reduce(torch.ones(1), group=tp)
    except RuntimeError:
        waited = time.monotonic() - start
        assert TIMEOUT_S * 0.9 <= waited < 60, f"waited {waited:.1f} s"
    else:
        raise AssertionError("an all-reduce that its peer never joined returned")
elif rank in (2, 3):  # the other replica's group works as before
    value = torch.ones(1)
    dist.all_reduce(value, group=tp)
    assert value.item() == 2
dist.barrier()  # rank 1 waits here, at the world group's, until rank 0 has timed out
dist.destroy_process_group()
print("ok", rank, flush=True)
