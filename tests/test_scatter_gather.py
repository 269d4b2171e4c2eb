"""Pipeline messages split over the tensor-parallel group: the rule, its cost, and real gloo ranks
that send only their share and receive the whole tensor, or keep the slice of a sequence-parallel one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from autopart.ir.tensors import TensorMeta
from autopart.runtime.p2p import Scatter, recv_tensors, send_tensors
from autopart.ir.scatter_gather import gathered, held_bytes, held_shape, parts, sent_bytes
from autopart.predict.messages import message_seconds
from cost_models import get_cost_model
from tests.distributed import fork_ranks, gloo_group


@pytest.mark.parametrize("numel, tp, expected", [(12, 1, 1), (12, 2, 2), (12, 4, 4), (10, 4, 1), (1, 2, 1), (0, 2, 1)])
def test_a_tensor_splits_where_the_degree_divides_it(numel, tp, expected):
    assert parts(numel, tp) == expected


def test_a_split_message_costs_its_share_across_nodes_and_a_gather_inside_one():
    cost_model = get_cost_model("a100-80gb")
    meta = TensorMeta(shape=(1, 2048, 12288), dtype="bfloat16")
    whole = cost_model.p2p_time(meta.nbytes, across_nodes=True)
    assert message_seconds(cost_model, [meta], tp=1, across_nodes=True, tp_nodes=1) == whole
    split = message_seconds(cost_model, [meta], tp=8, across_nodes=True, tp_nodes=1)
    share = cost_model.p2p_time(meta.nbytes // 8, across_nodes=True)
    gather = cost_model.collective_time("all_gather", meta.nbytes, 8)
    assert split == pytest.approx(share + gather)
    assert split < whole / 2  # the NVLink gather is far cheaper than the InfiniBand bytes it saves
    odd = TensorMeta(shape=(3, 5), dtype="float32")  # 15 elements: travels whole
    assert message_seconds(cost_model, [odd], tp=8, across_nodes=True, tp_nodes=1) == (
        cost_model.p2p_time(odd.nbytes, across_nodes=True)
    )


def test_a_sequence_parallel_slice_travels_as_it_is_held():
    meta = TensorMeta(shape=(2, 8, 6), dtype="bfloat16", split_dim=1)
    assert held_shape(meta, 4) == (2, 2, 6) and held_shape(meta, 1) == (2, 8, 6)
    assert held_bytes(meta, 4) == sent_bytes(meta, 4) == meta.nbytes // 4 and not gathered(meta, 4)
    whole = TensorMeta(shape=(2, 8, 6), dtype="bfloat16")
    assert held_bytes(whole, 4) == whole.nbytes and sent_bytes(whole, 4) == whole.nbytes // 4 and gathered(whole, 4)
    with pytest.raises(ValueError, match="cannot split 3 ways along dim 1"):
        held_shape(meta, 3)
    cost_model = get_cost_model("a100-80gb")
    assert message_seconds(cost_model, [meta], tp=4, across_nodes=True, tp_nodes=1) == (
        cost_model.p2p_time(meta.nbytes // 4, across_nodes=True)  # no gather: the receiver keeps the slice
    )


def test_a_split_dim_round_trips_through_json_and_older_plans_read_the_same():
    meta = TensorMeta(shape=(2, 8, 6), dtype="float32", split_dim=1)
    assert TensorMeta.from_json(meta.to_json()) == meta
    assert TensorMeta(shape=(2,), dtype="float32").to_json() == {"shape": [2], "dtype": "float32"}


METAS = [TensorMeta(shape=(2, 3, 4), dtype="float32"), TensorMeta(shape=(5,), dtype="float32"),  # 24 split, 5 whole
         TensorMeta(shape=(2, 4, 3), dtype="float32", split_dim=1)]  # each rank's slice of the sequence


def _expected() -> list[torch.Tensor]:
    return [torch.arange(24, dtype=torch.float32).view(2, 3, 4), torch.arange(5, dtype=torch.float32) - 7,
            torch.arange(24, dtype=torch.float32).view(2, 4, 3) * 3]


def _held(tp_rank: int) -> list[torch.Tensor]:
    """What tensor-parallel rank ``tp_rank`` holds of ``_expected``: the whole of the replicated ones,
    its half of the sequence of the split one."""
    whole = _expected()
    return [whole[0], whole[1], whole[2].chunk(2, dim=1)[tp_rank].contiguous()]


def _rank(rank: int, port: int) -> None:
    """Ranks 0 and 1 are one stage's tensor-parallel group, 2 and 3 the next stage's."""
    with gloo_group(rank, port, 4):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        tp_rank = rank % 2
        scatter = Scatter(groups[rank // 2], tp_rank, 2)
        if rank < 2:
            tensors = _held(tp_rank)
            # spoil the half of the split tensor that the other rank sends: it must not travel from here
            flat = tensors[0].view(-1)
            flat[(1 - tp_rank) * 12 : (2 - tp_rank) * 12] = float("nan")
            for work in send_tensors(tensors, rank + 2, scatter, metas=METAS):
                work.wait()
        else:
            received = recv_tensors(METAS, rank - 2, torch.device("cpu"), scatter)
            if [tuple(t.shape) for t in received] != [(2, 3, 4), (5,), (2, 2, 3)]:
                os._exit(2)
            if not all(torch.equal(a, b) for a, b in zip(received, _held(tp_rank))):
                os._exit(1)


@pytest.mark.multiprocess
def test_each_rank_sends_its_share_and_every_receiver_gets_the_whole_tensor_or_its_slice():
    assert fork_ranks(_rank, 4) == [0, 0, 0, 0]  # a receiver exits 1 on a wrong tensor, 2 on a wrong shape
