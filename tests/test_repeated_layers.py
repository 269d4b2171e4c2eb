"""Finding a model's repeated layers (``autopart.codegen.layers``), which stage programs write
once and ZeRO-3 makes FSDP units of: the longest run of a repeating group of blocks."""

import random

from autopart.codegen.layers import _LONGEST_PERIOD, _best_run, _prefix


def _longest_runs_by_definition(signatures, lo, hi, parameters):
    """``_best_run`` as its docstring defines it: every period and start, each run grown one
    instance at a time while the next instance equals the first."""
    best, best_key = None, None
    for period in range(1, min(_LONGEST_PERIOD, (hi - lo) // 2) + 1):
        for start in range(lo, hi - 2 * period + 1):
            count = 1
            while start + (count + 1) * period <= hi and \
                    signatures[start + count * period: start + (count + 1) * period] == signatures[start: start + period]:
                count += 1
            if count >= 2:
                read = [p for names in parameters[start: start + period] for p in names]
                key = (period * count, _prefix(read).count(".") + 1 if read else 0, -period, -start)
                if best_key is None or key > best_key:
                    best, best_key = (start, period, count), key
    return best


def test_the_longest_run_is_found_in_one_pass_per_period_as_by_its_definition():
    rng = random.Random(7)
    for _ in range(1500):
        alphabet = "abcd"[: rng.randint(1, 4)]
        layer = [rng.choice(alphabet) for _ in range(rng.randint(1, 6))]
        signatures: list[str] = []
        while len(signatures) < 50:
            signatures += layer if rng.random() < 0.8 else [rng.choice(alphabet)]
        n = rng.randint(1, 50)
        signatures_t = tuple(signatures[:n])
        parameters = tuple(tuple(f"m{rng.randint(0, 3)}.l{rng.randint(0, 2)}.w" for _ in range(rng.randint(0, 2)))
                           for _ in range(n))
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        assert _best_run(signatures_t, lo, hi, parameters) == _longest_runs_by_definition(signatures_t, lo, hi, parameters)
