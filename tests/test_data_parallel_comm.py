"""Where the data-parallel collectives of each ZeRO level fall in the step
(`autopart.predict.data_parallel`): gathers before the computation they feed, reduce-scatters
overlapped on a GPU but not on a CPU, and the once-a-step collectives in the tail."""

import pytest

from autopart.predict.data_parallel import data_parallel_comm


class LinearCollectives:
    """Seconds = bytes / 1e9 per collective, whatever its kind; an all-reduce is twice that."""

    def collective_time(self, kind: str, nbytes: float, group_size: int, *, nodes: int = 1,
                        members: int | None = None) -> float:
        return nbytes / 1e9 * (2 if kind == "all_reduce" else 1)


def comm(zero: int, *, overlapped: bool, dp: int = 4, hidden_behind_s: float = 2.0):
    return data_parallel_comm(zero, 1e9, dp=dp, nodes=1, cost_model=LinearCollectives(),
                              overlapped=overlapped, hidden_behind_s=hidden_behind_s)


@pytest.mark.parametrize("overlapped", [False, True])
def test_replicated_levels_leave_only_zero_1_s_gather_after_the_step(overlapped):
    """Their all-reduce runs beside the backward (`autopart.predict.reduction`), not here."""
    assert comm(0, overlapped=overlapped) == type(comm(0, overlapped=False))(0.0, 0.0, 0.0)
    assert comm(1, overlapped=overlapped).tail_s == pytest.approx(1.0)  # the updated shards gathered
    assert comm(1, overlapped=overlapped).forward_s == comm(1, overlapped=overlapped).backward_s == 0.0


def test_zero_2_gathers_once_a_step_and_reduces_after_every_backward():
    on_cpu, on_gpu = comm(2, overlapped=False), comm(2, overlapped=True)
    assert (on_cpu.forward_s, on_cpu.backward_s, on_cpu.tail_s) == pytest.approx((0.0, 1.0, 1.0))
    assert (on_gpu.forward_s, on_gpu.backward_s, on_gpu.tail_s) == pytest.approx((0.0, 0.0, 2.0))  # the last waited for


def test_zero_3_gathers_before_every_forward_and_backward():
    on_cpu, on_gpu = comm(3, overlapped=False), comm(3, overlapped=True)
    assert (on_cpu.forward_s, on_cpu.backward_s, on_cpu.tail_s) == pytest.approx((1.0, 2.0, 0.0))
    assert (on_gpu.forward_s, on_gpu.backward_s, on_gpu.tail_s) == pytest.approx((1.0, 1.0, 1.0))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_one_replica_communicates_nothing(zero):
    assert comm(zero, overlapped=False, dp=1) == type(comm(zero, overlapped=False, dp=1))()


def test_a_reduce_scatter_longer_than_the_next_action_shows_its_excess():
    assert comm(2, overlapped=True, hidden_behind_s=0.25).backward_s == pytest.approx(0.75)
    assert comm(3, overlapped=True, hidden_behind_s=0.25).backward_s == pytest.approx(1.75)
    assert comm(2, overlapped=False, hidden_behind_s=5.0).backward_s == pytest.approx(1.0)  # a CPU hides nothing


@pytest.mark.parametrize("dtype, gathered", [("fp32", 1.0), ("bf16-autocast", 1.0), ("bf16", 0.5)])
def test_the_gathers_move_the_weights_in_the_dtype_the_replicas_compute_with(dtype, gathered):
    """Under ``bf16`` the distributed optimizer's owners broadcast bf16 weights
    (`autopart.runtime.sharded_masters`), and FSDP casts its fp32 shards to bf16 before it
    gathers them (`autopart.runtime.fully_sharded`): half the bytes of fp32 weights. The
    gradients are reduced in fp32 at every level."""
    def run(zero: int):
        return data_parallel_comm(zero, 1e9, dp=4, nodes=1, cost_model=LinearCollectives(), overlapped=False,
                                  dtype=dtype)  # fmt: skip

    assert run(1).tail_s == pytest.approx(gathered)
    assert (run(2).backward_s, run(2).tail_s) == pytest.approx((1.0, gathered))
    assert (run(3).forward_s, run(3).backward_s) == pytest.approx((gathered, gathered + 1.0))


def test_frozen_bytes_are_gathered_and_not_reduce_scattered():
    """A stage whose parameters are a quarter trained (a fine-tune's frozen base beside them): its
    weights are gathered whole, its gradients, a quarter of them, alone reduce-scattered."""
    def frozen(zero: int):
        return data_parallel_comm(zero, 1e9, dp=4, nodes=1, cost_model=LinearCollectives(), overlapped=False,
                                  hidden_behind_s=2.0, trained=0.25)

    assert (frozen(2).backward_s, frozen(2).tail_s) == pytest.approx((0.25, 1.0))  # the scatter, the gather
    assert (frozen(3).forward_s, frozen(3).backward_s) == pytest.approx((1.0, 1.25))  # gathered; again, and scattered
