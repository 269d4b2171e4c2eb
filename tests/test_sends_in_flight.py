"""A rank lets go of each send once it is done (`autopart.runtime.executor.unfinished`): a send's
handle holds the tensor it sends, so one kept to the step's end kept every microbatch's activation
alive past the backward that freed it."""

import torch
import torch.distributed as dist

from autopart.runtime.executor import unfinished
from tests.distributed import fork_ranks, gloo_group


def _two_sends(rank: int, port: int) -> None:
    with gloo_group(rank, port, 2):
        if rank == 0:
            first, second = dist.isend(torch.ones(8), 1), dist.isend(torch.full((8,), 2.0), 1)
            dist.barrier()  # the peer took the first and not yet the second
            first.wait()  # what finishing looks like under gloo (NCCL's finish on their own)
            assert unfinished([first, second]) == [second]
            dist.barrier()
            second.wait()
            assert unfinished([first, second]) == []
        else:
            taken = torch.empty(8)
            dist.recv(taken, 0)
            dist.barrier()
            dist.barrier()
            dist.recv(taken, 0)
            assert taken.eq(2.0).all()


def test_a_finished_send_is_let_go_and_one_under_way_is_kept():
    assert fork_ranks(_two_sends, 2, timeout=60) == [0, 0]
