"""The search costs a fine-tune whose first layers are frozen (tests/test_frozen.py's ``PREFIX``:
a frozen embedding and three frozen blocks below three trained ones) as its plans then run."""

import pytest

from autopart.options import CompileOptions
from autopart.solve.planner import FrontTable
from tests.test_frozen import PREFIX

A100 = dict(world_size=4, microbatches=4, global_batch_size=8, device="a100-80gb", measure=False)


@pytest.fixture
def prefix(tmp_path):
    model = tmp_path / "prefix.py"
    model.write_text(PREFIX)
    return model


def test_a_trained_block_sharded_is_not_costed_as_its_frozen_twin(prefix):
    """A trained block and a frozen one of the same ops (same signature) shared one tensor-parallel
    solution, the first one's: the trained blocks after a frozen prefix were timed at TP 2 with
    the frozen block's time, no backward, under the floor no sharding of them beats (the search's
    early bound then stood above its exact one). Each kind now has its own solution."""
    table = FrontTable(CompileOptions(model=prefix, **A100))
    sharded = table.chain_costs(micro_batch_size=2, tp=2, dtype="fp32")
    floor = table.optimistic_costs(micro_batch_size=2, tp=2, dtype="fp32")
    whole = table.chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    frozen, trained = range(1, 4), range(4, 7)  # blocks 1-3 frozen, 4-6 trained, each a linear, tanh and add
    assert all(whole.backward_s[k] == 0 for k in frozen) and all(whole.backward_s[k] > 0 for k in trained)
    for k in range(len(sharded)):
        assert sharded.forward_s[k] + sharded.backward_s[k] >= (floor.forward_s[k] + floor.backward_s[k]) * (1 - 1e-9), k
    assert min(sharded.backward_s[k] for k in trained) > max(sharded.backward_s[k] for k in frozen) == 0
