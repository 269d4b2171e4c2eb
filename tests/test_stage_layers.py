"""``--stage-layers``: pipeline cuts pinned by the number of repeated layers on each stage, as
Megatron-LM's first/last-stage layer counts and DeepSpeed's partition methods set them."""

import re

import pytest

from autopart.driver import compile as compile_model
from autopart.ir.errors import ConfigError
from autopart.ir.plan import load_plan
from autopart.solve.stage_layers import layer_count_cuts, megatron_counts
from autopart.tools import cli
from tests.distributed import REPO, assert_same_training, compile_and_train
from tests.refusals import call_cli

GPT = REPO / "examples" / "gpt.py"  # four layers h.0 .. h.3, tied embedding and head


@pytest.mark.parametrize(
    "counts, cuts",
    [
        ((1, 2), (2,)),  # the embedding (block 0) and layer h.0 first; h.1, h.2 and the head last
        ((2, 1), (3,)),
        ((1, 1, 1), (2, 3)),
    ],
)
def test_cuts_fall_after_the_last_block_of_each_stage_s_layers(counts, cuts):
    layers = [None, "h.0", "h.0", "h.1", "h.2", "h.2", None]
    assert layer_count_cuts(layers, counts) == cuts


@pytest.mark.parametrize(
    "layers, counts, pattern",
    [
        ([None, "h.0", "h.1", None], (1, 2), r"sums to 3 layers but the model has 2 \(h\.0 to h\.1\); give counts that sum to 2"),
        ([None, "h.0", "h.1", None], (1,) * 1 + (0,), r"sums to 1 layers but the model has 2"),
        ([None, None], (1, 1), r"this model has none"),
    ],
)
def test_counts_that_do_not_match_the_model_are_refused(layers, counts, pattern):
    with pytest.raises(ConfigError, match=pattern):
        layer_count_cuts(layers, counts)


@pytest.mark.parametrize(
    "layers, stages, first, last, counts",
    [
        (70, 12, 5, 5, (5,) + (6,) * 10 + (5,)),  # BLOOM's split in Megatron's form
        (8, 3, 2, None, (2, 3, 3)),
        (8, 3, None, 4, (2, 2, 4)),
        (4, 2, 1, 3, (1, 3)),
    ],
)
def test_megatron_form_splits_the_rest_equally(layers, stages, first, last, counts):
    assert megatron_counts(layers, stages, first=first, last=last) == counts


@pytest.mark.parametrize("first, last", [(4, 5), (1, 2)])
def test_megatron_form_refuses_a_rest_that_does_not_divide(first, last):
    with pytest.raises(ConfigError, match=r"leave \d+ of the model's 70 layers for 10 other stage\(s\)"):
        megatron_counts(70, 12, first=first, last=last)


def _layers_per_stage(plan) -> list[list[str]]:
    """Per stage, the repeated layers whose weights it holds (``h.1``), in order."""
    held = []
    for stage in plan.stages:
        layers = {m.group(1) for m in (re.match(r"^(h\.\d+)\.", p) for p in stage.parameters) if m}
        held.append(sorted(layers, key=lambda layer: int(layer[2:])))
    return held


@pytest.mark.parametrize(
    "pp, chunks, schedule, counts",
    [(2, 1, "1f1b", (1, 3)), (2, 1, "1f1b", (3, 1)), (2, 2, "interleaved", (1, 2, 0, 0))],
)
def test_compiled_stages_hold_exactly_the_pinned_layers(pp, chunks, schedule, counts):
    if 0 in counts:  # four stages of four layers: one each
        counts = (1, 1, 1, 1)
    plan = compile_model(GPT, pp=pp, chunks=chunks, schedule=schedule, microbatches=4, micro_batch_size=2,
                         stage_layers=counts, measure=False)  # fmt: skip
    assert plan.provenance.solver_status == "pinned"
    first = 0
    for stage, count in zip(_layers_per_stage(plan), counts):
        assert stage == [f"h.{k}" for k in range(first, first + count)]
        first += count
    assert "wte.weight" in plan.stages[0].parameters and "ln_f.weight" in plan.stages[-1].parameters


def test_pinned_layers_differ_from_the_solver_s_cuts():
    """The pin is what decides: the solver alone cuts this model 2 + 2 (equal layers, tied embedding)."""
    solved = compile_model(GPT, pp=2, microbatches=4, micro_batch_size=2, measure=False)
    pinned = compile_model(GPT, pp=2, microbatches=4, micro_batch_size=2, stage_layers=(1, 3), measure=False)
    assert [len(s) for s in _layers_per_stage(pinned)] == [1, 3]
    assert [len(s) for s in _layers_per_stage(solved)] != [1, 3]


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--stage-layers", "1,2"], r"--stage-layers sums to 3 layers but the model has 4 \(h\.0 to h\.3\)"),
        (["--last-stage-layers", "3", "--first-stage-layers", "2"],
         r"leave -1 of the model's 4 layers for 0 other stage\(s\)"),
        (["--stage-layers", "1,3", "--memory", "0.0001"],
         r"the --stage-layers split needs \d+\.\d+ GiB on pipeline rank \d, more than the 0\.00 GiB limit"),
    ],
)
def test_cli_refuses_a_split_the_model_contradicts(tmp_path, capsys, extra, pattern):
    out = tmp_path / "out"
    line = call_cli(capsys, "compile", str(GPT), "-o", str(out), "--pp", "2", "--no-measure", *extra, watch=(tmp_path,))
    assert re.search(pattern, line), line
    assert not out.exists()


@pytest.mark.multiprocess
def test_uneven_split_trains_like_one_process(tmp_path):
    run = compile_and_train(tmp_path, "gpt", pp=2, microbatches=4, schedule="1f1b", stage_layers=(3, 1))
    assert [len(s) for s in _layers_per_stage(run.plan)] == [3, 1]
    assert run.plan.tied_parameters == {"wte.weight": (0, 1)}
    assert_same_training(run, optimizer="sgd", lr=0.1)


def test_cli_takes_megatron_s_form(tmp_path):
    out = tmp_path / "out"
    cli.main(["compile", str(GPT), "-o", str(out), "--pp", "3", "--microbatches", "4", "--first-stage-layers", "2",
              "--no-measure"])  # fmt: skip
    assert [len(s) for s in _layers_per_stage(load_plan(out / "plan.json"))] == [2, 1, 1]


def test_cli_passes_the_counts_through(tmp_path):
    out = tmp_path / "out"
    cli.main(["compile", str(GPT), "-o", str(out), "--pp", "2", "--microbatches", "4", "--stage-layers", "3,1",
              "--no-measure"])  # fmt: skip
    plan = load_plan(out / "plan.json")
    assert plan.provenance.solver_status == "pinned"
    assert [len(s) for s in _layers_per_stage(plan)] == [3, 1]
