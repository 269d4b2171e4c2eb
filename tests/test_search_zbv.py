"""ZB-V in the search's space: where it is a candidate, and its closed-form step against the
simulator running the real action lists."""

import random

import pytest

from autopart.predict.timeline import simulate_pipeline
from autopart.solve.search import SearchSpace
from autopart.solve.vshape import zbv_fits, zbv_pipeline_s


def test_zbv_is_a_candidate_where_its_v_fits():
    space = SearchSpace(world_size=4, global_batch_size=16, tp=(1,), micro_batch_size=(1, 4))
    chosen = {(layout.pp, layout.microbatches, layout.chunks) for layout in space.layouts(16) if layout.schedule == "zbv"}
    # pp 2 x dp 2 has 8 or 2 microbatches, pp 4 has 16 or 4: 2 and 4 are fewer than 2 x pp - 1
    assert chosen == {(2, 8, 2), (4, 16, 2)}
    assert not zbv_fits(4, 8, 7, None)  # 8 stages need 8 blocks
    assert not zbv_fits(2, 4, 8, (1,)) and zbv_fits(2, 4, 8, (2,))


@pytest.mark.parametrize("seed", range(3))
def test_zbv_estimate_follows_the_simulated_lists(seed):
    rng = random.Random(seed)
    for _ in range(40):
        p = rng.choice([2, 3, 4, 8])
        m = rng.choice([2 * p - 1, 2 * p, 4 * p])
        times = [rng.uniform(1, 2) for _ in range(2 * p)]
        weights = [t * rng.uniform(0.2, 0.4) for t in times]
        forward = [t / 3 for t in times]
        simulated = simulate_pipeline(
            kind="zbv", ranks=p, microbatches=m, chunks=2, forward_s=tuple(forward),
            backward_s=tuple(t - f for t, f in zip(times, forward)), weight_s=tuple(weights),
            transfer_s=(0.0,) * (2 * p - 1),
        ).step_s
        assert 0.95 <= zbv_pipeline_s(tuple(times), tuple(weights), p, m) / simulated <= 1.12
