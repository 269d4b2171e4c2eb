"""Finding a model's repeated layers (``autopart.codegen.layers``), which stage programs write
once and ZeRO-3 makes FSDP units of: the longest runs of a repeating group of blocks."""

import random
from types import SimpleNamespace

from autopart.codegen.layers import layer_instances


def _depth(targets: list[str]) -> int:
    """How deep the module path that holds every one of ``targets`` is: 0 for no targets, at
    least 1 for any (the model itself)."""
    if not targets:
        return 0
    common = 0
    for level in zip(*(t.split(".")[:-1] for t in targets)):
        if len(set(level)) != 1:
            break
        common += 1
    return max(common, 1)


def _best_run_by_definition(signatures, lo, hi, parameters):
    """The run covering most blocks of ``signatures[lo:hi]`` (ties: deepest in the module tree,
    then the shorter period, then the earlier start), every period and start tried, each run grown
    one instance at a time while the next instance equals the first. The chains here are too
    short to reach the longest period the module considers."""
    best, best_key = None, None
    for period in range(1, (hi - lo) // 2 + 1):
        for start in range(lo, hi - 2 * period + 1):
            count = 1
            while start + (count + 1) * period <= hi and \
                    signatures[start + count * period: start + (count + 1) * period] == signatures[start: start + period]:
                count += 1
            if count >= 2:
                read = [p for names in parameters[start: start + period] for p in names]
                key = (period * count, _depth(read), -period, -start)
                if best_key is None or key > best_key:
                    best, best_key = (start, period, count), key
    return best


def _instances_by_definition(signatures, parameters) -> list[tuple[int, int]]:
    """Every instance of the best run, then of the best runs left of it and right of it, and so on."""
    found, segments = [], [(0, len(signatures))]
    while segments:
        lo, hi = segments.pop()
        run = _best_run_by_definition(signatures, lo, hi, parameters)
        if run is not None:
            start, period, count = run
            found += [(start + k * period, start + (k + 1) * period) for k in range(count)]
            segments += [(lo, start), (start + period * count, hi)]
    return sorted(found)


def test_the_repeated_layers_are_found_in_one_pass_per_period_as_by_their_definition():
    rng = random.Random(7)
    for _ in range(800):
        alphabet = "abcd"[: rng.randint(1, 4)]
        layer = [rng.choice(alphabet) for _ in range(rng.randint(1, 6))]
        signatures: list[str] = []
        while len(signatures) < 50:
            signatures += layer if rng.random() < 0.8 else [rng.choice(alphabet)]
        signatures = signatures[: rng.randint(1, 50)]
        parameters = [tuple(f"m{rng.randint(0, 3)}.l{rng.randint(0, 2)}.w" for _ in range(rng.randint(0, 2)))
                      for _ in signatures]
        chain = SimpleNamespace(blocks=[SimpleNamespace(signature=s, parameters=p) for s, p in zip(signatures, parameters)])
        found = sorted((first, end) for first, end, _ in layer_instances(chain))
        assert found == _instances_by_definition(tuple(signatures), tuple(parameters))
