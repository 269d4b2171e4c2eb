"""A rank lets go of each send once it is done (`autopart.runtime.executor.unfinished`): a send's
handle holds the tensor it sends, so one kept to the step's end kept every microbatch's activation
alive past the backward that freed it. NCCL's handles finish by themselves, which no CPU run has:
the handles below that do are stand-ins for them; gloo's are real."""

import pytest
import torch
import torch.distributed as dist

from autopart.runtime.executor import unfinished
from tests.distributed import fork_ranks, gloo_group


def _two_sends(rank: int, port: int) -> None:
    with gloo_group(rank, port, 2):
        if rank == 0:
            first, second = dist.isend(torch.ones(8), 1), dist.isend(torch.full((8,), 2.0), 1)
            dist.barrier()  # the peer took the first and not yet the second
            # gloo calls a send done only once waited for (NCCL's are done by themselves): on the
            # CPU both stay to the step's end, waited for once there
            assert unfinished([first, second]) == [first, second]
            dist.barrier()
            first.wait()
            second.wait()
        else:
            taken = torch.empty(8)
            dist.recv(taken, 0)
            dist.barrier()
            dist.barrier()
            dist.recv(taken, 0)
            assert taken.eq(2.0).all()


def test_gloo_sends_stay_until_the_step_s_end():
    assert fork_ranks(_two_sends, 2, timeout=60) == [0, 0]


class _Finished:
    """A send's handle as NCCL's reports one: done by itself, its error raised by wait()."""

    def __init__(self, error: Exception | None = None):
        self.error, self.waited = error, False

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


def test_a_finished_send_is_let_go_one_that_failed_raises_and_one_under_way_is_kept():
    done, under_way = _Finished(), _Finished()
    under_way.is_completed = lambda: False
    assert unfinished([done, under_way]) == [under_way] and done.waited and not under_way.waited
    with pytest.raises(RuntimeError, match="peer lost"):
        unfinished([_Finished(RuntimeError("peer lost"))])
