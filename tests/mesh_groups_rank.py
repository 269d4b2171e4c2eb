"""One rank of tests/test_mesh_groups.py: the mesh's groups have their axes' ranks and the
mesh's timeout.

The timeout is read from each group's gloo backend, not waited for: every collective of these
groups has it, the working ones too, and a timeout short enough to wait for in a test is one a
loaded machine can reach between two ranks that are otherwise fine."""

import datetime

import torch
import torch.distributed as dist

from autopart.runtime.mesh import Mesh, group_of

TIMEOUT_S = 123.0  # not torch's default (30 minutes on gloo), and more than any healthy wait here

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
value = torch.ones(1)
dist.all_reduce(value, group=tp)
assert value.item() == 2
for group in (tp, dp, device_mesh["pp"].get_group()):
    # torch keeps a group's timeout in its backend's options and has no public reader of it
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    assert timeout == datetime.timedelta(seconds=TIMEOUT_S), timeout
dist.barrier()
dist.destroy_process_group()
print("ok", rank, flush=True)
