"""The running sums the cutter reads (autopart/solve/chain_costs.py ``chain_sums``): a stage's
seconds alone, asked before its memory, are the seconds its full figures give."""

from __future__ import annotations

import random

import pytest

from autopart.ir.recompute import RECOMPUTE_MODES
from autopart.solve.chain_costs import chain_sums
from tests.synthetic_chains import random_table


@pytest.mark.parametrize("seed", range(5))
def test_a_stage_s_seconds_alone_are_those_of_its_parts(seed: int) -> None:
    rng = random.Random(seed)
    costs = random_table(rng, layers=rng.randint(1, 6)).chain_costs(micro_batch_size=rng.randint(1, 4), tp=1,
                                                                    dtype="fp32")
    sums = chain_sums(costs)
    for first in range(len(costs)):
        for last in range(first, len(costs)):
            for mode in RECOMPUTE_MODES:
                assert sums.seconds(first, last, mode) == sums.parts(first, last, mode, transient=2)[0]
    with pytest.raises(ValueError, match="unknown recompute mode"):
        sums.seconds(0, 0, "some")
