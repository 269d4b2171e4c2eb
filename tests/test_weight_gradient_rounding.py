"""A stage whose backward is all weight gradients (the embedding alone) keeps its weight-gradient
time within its backward, whatever the rounding of the sums."""

import json
import math
from dataclasses import replace
from pathlib import Path

import autopart.compiler
from autopart.compiler import CompileOptions, _front, compile_to_directory

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"


def test_an_embedding_only_stage_keeps_its_weight_gradient_within_its_backward(tmp_path, monkeypatch):
    options = CompileOptions(model=TINY_GPT, pp=2, microbatches=4, micro_batch_size=2, schedule="zb-h1",
                             time_limit_s=5)
    compile_to_directory(options, tmp_path / "first")
    blocks = _front(options, 2).chain.blocks
    plan = json.loads((tmp_path / "first" / "plan.json").read_text())
    plan["stages"][0]["nodes"] = list(blocks[0].nodes)  # the embedding alone
    plan["stages"][1]["nodes"] = [n for block in blocks[1:] for n in block.nodes]
    (tmp_path / "pinned.json").write_text(json.dumps(plan))
    original = autopart.compiler._block_times

    def all_weight_gradients(front):  # block 0's backward all weight gradients, summed a rounding above
        times = original(front)
        forward, backward, _ = times[0]
        times[0] = (forward, backward, math.nextafter((forward + backward) - forward, math.inf))
        return times

    monkeypatch.setattr(autopart.compiler, "_block_times", all_weight_gradients)
    pinned, _ = compile_to_directory(replace(options, plan=tmp_path / "pinned.json"), tmp_path / "pinned")
    first = pinned.stages[0]
    assert first.blocks == (0, 0)
    assert first.backward_weight_s == first.backward_s > 0
