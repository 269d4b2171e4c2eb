"""A rank of several stages chooses its stages' recompute modes all at once (`autopart.solve.rank_room`)."""

import itertools
import random

import pytest

from autopart.solve.rank_room import fastest_fitting, rank_bytes


def scanned(options, moments, budget):
    """What a plain scan of every choice in product order keeps: the first of least time that fits."""
    best = None
    for combo in itertools.product(*options):
        time_s = 0
        for option in combo:
            time_s += option[1]
        memory = sum(option[3] for option in combo) if moments is None else rank_bytes([o[4] for o in combo], moments)
        if memory <= budget and (best is None or time_s < best[0]):
            best = (time_s, combo, memory)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_choice_is_the_first_fastest_that_fits_as_a_scan_finds_it(seed):
    rng = random.Random(seed)
    stages = rng.randint(2, 4)
    moments = None if seed % 4 == 0 else tuple(tuple(rng.randint(0, 6) for _ in range(stages))
                                               for _ in range(rng.randint(1, 5)))  # fmt: skip
    options = []
    for _ in range(stages):
        stage = []
        for mode in ("none", "selective", "full")[: rng.randint(1, 3)]:
            parts = (rng.randint(0, 10**9), rng.randint(0, 10**8), rng.randint(0, 10**7))
            # times from a few values, so that ties between choices occur and the first must win
            stage.append((mode, rng.choice((0.5, 1.0, 1.25)), 0.0, parts[0] + 3 * parts[1] + parts[2], parts))
        options.append(stage)
    budgets = [rng.randint(0, 5 * 10**9) for _ in range(5)]
    for budget in budgets:
        assert fastest_fitting(options, moments, budget) == scanned(options, moments, budget)
