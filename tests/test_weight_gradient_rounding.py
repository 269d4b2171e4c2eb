"""A stage whose backward is all weight gradients (the embedding alone) keeps its weight-gradient
time within its backward, whatever the rounding of the sums."""

import math
from dataclasses import replace
from pathlib import Path

import autopart.solve.assemble
from autopart.driver import CompileOptions, compile_to_directory
from autopart.passes.front import build_front
from autopart.solve.assemble import plan_from_cuts, pipeline_problem

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"


def test_an_embedding_only_stage_keeps_its_weight_gradient_within_its_backward(tmp_path, monkeypatch):
    options = CompileOptions(model=TINY_GPT, pp=2, microbatches=4, micro_batch_size=2, schedule="zb-h1",
                             time_limit_s=5)
    compile_to_directory(options, tmp_path / "first")
    # the embedding alone on stage 0 (its stage ends at block 0): the whole plan, every field that
    # follows from the cut with it, as --plan checks a plan
    batch = options.batch_shape()
    front = build_front(options, batch[2])
    moved = plan_from_cuts(options, front, pipeline_problem(options, front, batch[1]), (0,), batch, ("pinned", 0.0, 0.0))
    moved.save(tmp_path / "pinned.json")
    original = autopart.solve.assemble.block_seconds

    def all_weight_gradients(front):  # block 0's backward all weight gradients, summed a rounding above
        times = original(front)
        forward, backward, _ = times[0]
        times[0] = (forward, backward, math.nextafter((forward + backward) - forward, math.inf))
        return times

    monkeypatch.setattr(autopart.solve.assemble, "block_seconds", all_weight_gradients)
    pinned, _ = compile_to_directory(replace(options, plan=tmp_path / "pinned.json"), tmp_path / "pinned")
    first = pinned.stages[0]
    assert first.blocks == (0, 0)
    assert first.backward_weight_s == first.backward_s > 0
