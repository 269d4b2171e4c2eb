"""ZeRO-1's optimizer state after a change of partition: each replica saves the state of the
parameters it owns under its own prefix (``optim/dp_<r>/...``); a replica that owns a parameter
when the run resumes reads its state wherever it was saved. The partition is torch's
(``ZeroRedundancyOptimizer``) or autopart's (the bf16 masters): another version of either may
deal the parameters out differently under the same plan, and the moments must not restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopart.runtime.checkpoint import restore_checkpoint, save_checkpoint, training_state
from autopart.runtime.optim import make_optimizer
from tests.distributed import fork_ranks, gloo_group, replica_model


def _resume_as_another_replica(rank: int, port: int, folder: Path, saved_as: int, masters: bool) -> None:
    """One replica (it owns every parameter) saves its state as replica ``saved_as`` would have,
    then a fresh model and optimizer resume from it as replica 0. ``masters``: bf16's distributed
    optimizer (`autopart.runtime.sharded_masters`), else torch's ``ZeroRedundancyOptimizer``."""
    import torch.distributed as dist

    with gloo_group(rank, port, 1):
        out = folder / "out"
        out.mkdir()
        (out / "plan.json").write_text(json.dumps({"plan": "a stand-in"}))
        (out / "model.py").write_text("")
        model = replica_model()
        zero = {"zero_group": dist.group.WORLD, "shard_masters": masters}
        optimizer = make_optimizer("adamw", model.parameters(), 0.01, **zero)
        for step in range(2):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        state = training_state({0: model}, optimizer, rank=0, dp_rank=saved_as, tp_rank=0, zero=1, step=2, seed=0)
        path = save_checkpoint(folder / "ckpt", state, step=2, rank=0, out_dir=out, optimizer="adamw",
                               device=torch.device("cpu"))
        resumed = replica_model()
        fresh = make_optimizer("adamw", resumed.parameters(), 0.01, **zero)
        done = restore_checkpoint(path, {0: resumed}, fresh, rank=0, dp_rank=0, tp_rank=0, zero=1, seed=0,
                                  optimizer_name="adamw")
        assert done == 2
        for before, after in zip(model.parameters(), resumed.parameters()):
            assert torch.equal(before, after)
            kept, read = optimizer.optim.state[before], fresh.optim.state[after]
            assert set(read) == set(kept) == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(kept[name], read[name]) for name in kept)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32", "bf16-masters"])
@pytest.mark.parametrize("saved_as", [0, 1])
def test_a_replica_resumes_the_moments_another_replica_saved(tmp_path: Path, saved_as: int, masters: bool) -> None:
    assert fork_ranks(_resume_as_another_replica, 1, tmp_path, saved_as, masters) == [0]
