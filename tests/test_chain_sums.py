"""The running sums the cutter reads (autopart/solve/chain_costs.py ``chain_sums``): each of a
stage's figures, asked apart (seconds before memory, the parameters once for every mode), is the
figure summed block by block."""

from __future__ import annotations

import random

import pytest

from autopart.ir.recompute import RECOMPUTE_MODES
from autopart.solve.chain_costs import ChainCosts, chain_sums
from tests.synthetic_chains import random_table


def _summed(costs: ChainCosts, first: int, last: int, mode: str, transient: int) -> tuple:
    """The stage's figures by plain sums over its blocks (no layer split: the tables have none)."""
    blocks = range(first, last + 1)
    compute = sum(costs.forward_s[k] + costs.backward_s[k] for k in blocks)
    saved = sum(costs.saved_bytes[k] for k in blocks)
    received = costs.input_bytes + (costs.boundary_bytes[first - 1] if first else 0)
    if mode == "none":
        seconds, held = compute, (saved, 0)
    elif mode == "selective":
        selective = sum(costs.selective_saved_bytes[k] for k in blocks)
        seconds = compute + sum(costs.selective_recompute_s[k] for k in blocks)
        held = (received + selective, transient * max(0, saved - selective))
    else:
        seconds, held = compute + sum(costs.forward_s[k] for k in blocks), (received, transient * saved)
    mine = {p for k in blocks for p in costs.block_parameters[k]}
    parameters = sum(costs.parameter_state_bytes[p] for p in mine)  # a weight read before is held here again
    return seconds, parameters, held


@pytest.mark.parametrize("seed", range(6))
def test_a_stage_s_figures_asked_apart_are_its_blocks_summed(seed: int) -> None:
    rng = random.Random(seed)
    costs = random_table(rng, layers=rng.randint(1, 6), tied=seed % 2 == 0).chain_costs(
        micro_batch_size=rng.randint(1, 4), tp=1, dtype="fp32")
    sums = chain_sums(costs)
    for first in range(len(costs)):
        for last in range(first, len(costs)):
            for mode in RECOMPUTE_MODES:
                seconds, parameters, held = _summed(costs, first, last, mode, transient=3)
                assert sums.seconds(first, last, mode) == pytest.approx(seconds, rel=1e-12)
                assert sums.parameters(first, last) == parameters
                assert sums.held(first, last, mode, transient=3) == held
    with pytest.raises(ValueError, match="unknown recompute mode"):
        sums.seconds(0, 0, "some")


def test_weights_read_again_mid_chain_are_held_by_each_stage_that_reads_them_again() -> None:
    """Weights read by more than one block, the second reader anywhere (not only a tied head at
    the end): each stage holds every weight its blocks read, a stage that ends before any block
    reads a weight again its blocks' own alone (the cutter's shortcut, `_Sums.read_again_from`)."""
    costs = random_table(random.Random(7), layers=4, tied=True).chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    names = [list(block) for block in costs.block_parameters]
    first_read = next(k for k, block in enumerate(names) if block)
    again = names[first_read][:1]
    names[first_read + 2] += again  # read again two blocks on, and in the last block but one
    names[-2] += again
    costs = costs.changed(block_parameters=tuple(map(tuple, names)))
    sums = chain_sums(costs)
    assert sums.read_again_from == first_read + 2
    for first in range(len(costs)):
        for last in range(first, len(costs)):
            assert sums.parameters(first, last) == _summed(costs, first, last, "none", transient=1)[1]


def _layer_by_layer(costs: ChainCosts, first: int, last: int, transient: int) -> tuple:
    """Full recompute's figures layer by layer, by plain sums: the layers the stage holds whole
    keep what enters them and run again; the other blocks keep what they save; without a whole
    layer, the stage checkpoints whole."""
    whole = [(a, b) for a, b in costs.layer_spans if first <= a and b - 1 <= last]
    if not whole:
        return None
    inside = {k for a, b in whole for k in range(a, b)}
    blocks = range(first, last + 1)
    seconds = sum(costs.forward_s[k] + costs.backward_s[k] for k in blocks) + sum(costs.forward_s[k] for k in inside)
    held = sum(costs.saved_bytes[k] for k in blocks if k not in inside)
    held += sum(costs.boundary_bytes[a - 1] if a else 0 for a, _ in whole)
    largest = max(sum(costs.saved_bytes[a:b]) for a, b in costs.layer_spans)
    return seconds, (held, transient * largest)


@pytest.mark.parametrize("seed", range(6))
def test_full_recompute_layer_by_layer_is_its_blocks_summed(seed: int) -> None:
    """Layers of one to four blocks, cut anywhere: a stage's figures under full recompute are the
    plain sums of `_layer_by_layer`, and a stage that holds no layer whole keeps its input alone."""
    rng = random.Random(seed)
    costs = random_table(rng, layers=rng.randint(2, 6), tied=False).chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    spans, k = [], rng.randint(0, 2)
    while k + 2 <= len(costs) - 1:
        width = rng.randint(1, 4)
        if k + width <= len(costs):
            spans.append((k, k + width))
        k += width + rng.randint(0, 1)
    costs = costs.changed(layer_spans=tuple(spans)).checkpointing_layers()
    assert costs.layer_by_layer and spans
    sums = chain_sums(costs)
    without_layer = 0
    for first in range(len(costs)):
        for last in range(first, len(costs)):
            expected = _layer_by_layer(costs, first, last, transient=2)
            if expected is None:  # no layer whole: the stage's own checkpoint
                without_layer += 1
                expected = _summed(costs, first, last, "full", transient=2)[::2]
            assert sums.seconds(first, last, "full") == pytest.approx(expected[0], rel=1e-12), (first, last)
            assert sums.held(first, last, "full", transient=2) == expected[1], (first, last, spans)
            assert sums.held(first, last, "none") == _summed(costs, first, last, "none", transient=2)[2]
            stage_wide = _summed(costs, first, last, "stage", transient=2)  # whatever layers it holds
            assert sums.held(first, last, "stage", transient=2) == stage_wide[2]
            assert sums.seconds(first, last, "stage") == pytest.approx(stage_wide[0], rel=1e-12)
    assert without_layer > 0


def test_figures_kept_with_costs_are_made_once_and_not_carried_to_a_changed_copy() -> None:
    costs = random_table(random.Random(3), layers=3, tied=False).chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    made = []
    assert costs.kept(("made", 1), lambda: made.append(1) or len(made)) == 1
    assert costs.kept(("made", 1), lambda: made.append(1) or len(made)) == 1  # kept, not made again
    assert made == [1]
    slower = costs.changed(forward_s=tuple(2 * f for f in costs.forward_s))
    assert chain_sums(slower) is not chain_sums(costs)
    assert chain_sums(slower).seconds(0, len(costs) - 1, "none") == pytest.approx(
        sum(2 * f + b for f, b in zip(costs.forward_s, costs.backward_s)))
    assert slower.kept(("made", 1), lambda: 2) == 2
    # what does not depend on checkpointing layer by layer is carried to that copy; the running sums are not
    sums = chain_sums(costs)
    layered = costs.checkpointing_layers()
    assert layered.kept(("made", 1), lambda: 3) == 1
    assert chain_sums(layered) is not sums
