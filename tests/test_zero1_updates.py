"""ZeRO-1 in fp32 (`autopart.runtime.optim.make_optimizer` with a ``zero_group``): after the step
each owner sends its updated parameters in one broadcast, as the step model costs it (one gather
of the bytes, `autopart.predict.data_parallel`), not one per parameter: over gloo those many
small collectives cost half again a small model's step. With real gloo ranks the replicas still
step like one unsharded optimizer, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopart.runtime.optim import make_optimizer
from tests.distributed import fork_ranks, gloo_group, replica_model

DP = 2


def _replica(rank: int, port: int, folder: Path) -> None:
    with gloo_group(rank, port, DP):
        model, reference = replica_model(), replica_model()
        optimizer = make_optimizer("adamw", model.parameters(), 0.01, zero_group=dist.group.WORLD)
        plain = make_optimizer("adamw", reference.parameters(), 0.01)
        broadcast, calls = dist.broadcast, []

        def counted(*args, **kwargs):
            calls.append(1)
            return broadcast(*args, **kwargs)

        dist.broadcast = counted
        per_step = []
        for step in range(3):
            batch = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            for net in (model, reference):
                net(batch).pow(2).mean().backward()  # the same batch everywhere: no gradient to reduce
            before = len(calls)
            optimizer.step()
            per_step.append(len(calls) - before)
            plain.step()
            for opt in (optimizer, plain):
                opt.zero_grad(set_to_none=True)
        dist.broadcast = broadcast
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
        result = {"broadcasts": per_step, "parameters": len(list(model.parameters())), "same": same}
        (folder / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.multiprocess
def test_each_owner_sends_its_updated_parameters_in_one_broadcast(tmp_path):
    assert fork_ranks(_replica, DP, tmp_path) == [0] * DP
    for rank in range(DP):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["parameters"] > DP  # one broadcast per parameter would be more than one per owner
        assert result["broadcasts"] == [DP] * 3, result
        assert result["same"], "the sharded step must equal one unsharded AdamW's, bit for bit"
