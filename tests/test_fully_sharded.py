"""ZeRO-2 and ZeRO-3 (FSDP) train the model that one process trains: the same losses and final
weights with AdamW, over data parallelism alone and with a pipeline, with a tied embedding
across stages; a checkpoint saved sharded resumes bit for bit and consolidates into the
model's own state dict; and what cannot run together is refused in one line."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from autopart.driver import compile_to_directory
from autopart.ir.errors import ConfigError
from autopart.ir.model_file import eager_loss, load_model_file
from autopart.ir.plan import Plan
from autopart.options import CompileOptions
from autopart.runtime.data import global_batches
from tests.distributed import REPO, assert_same_training, compile_and_train, read_metrics, run_cli, run_ranks
from tests.distributed import stage_weights

LR = 1e-3  # AdamW's step is about lr whatever the gradient: a larger one turns reduction-order noise into 1e-5 moves


@pytest.mark.multiprocess
@pytest.mark.parametrize(("zero", "pp", "schedule", "chunks"), [
    (2, 1, "1f1b", 1), (3, 1, "1f1b", 1), (2, 2, "1f1b", 1), (3, 2, "1f1b", 1), (3, 2, "interleaved", 2),
])  # fmt: skip
def test_fully_sharded_trains_like_one_process(tmp_path, zero, pp, schedule, chunks):
    run = compile_and_train(tmp_path, "gpt", pp=pp, microbatches=4, schedule=schedule, chunks=chunks,
                            optimizer="adamw", lr=LR, dp=2, zero=zero)  # fmt: skip
    assert run.plan.zero == zero and run.plan.mesh["dp"] == 2
    if pp > 1:
        assert run.plan.tied_parameters, "the embedding is tied across stages: its shards are summed too"
    assert_same_training(run, optimizer="adamw", lr=LR, param_atol=1e-5)


@pytest.mark.multiprocess
def test_zero3_checkpoint_resumes_bit_identical_and_consolidates(tmp_path):
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, dp=2, zero=3, microbatches=2,
                                        micro_batch_size=2, schedule="1f1b", optimizer="adamw"), out)  # fmt: skip

    def train(folder: Path, steps: int, *extra: str) -> None:
        folder.mkdir(exist_ok=True)
        run_ranks(out, 4, "--steps", str(steps), "--lr", "0.01", "--optimizer", "adamw",
                  "--metrics", str(folder / "metrics.jsonl"), "--save-weights", str(folder / "final"),
                  "--checkpoint-dir", str(folder / "ckpt"), *extra)  # fmt: skip

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(whole, 4, "--checkpoint-every", "3")
    train(parts, 2)
    train(parts, 4, "--resume")
    assert [m["loss"] for m in read_metrics(parts / "metrics.jsonl")] == [m["loss"] for m in read_metrics(whole / "metrics.jsonl")]
    finals, expected = stage_weights(parts / "final"), stage_weights(whole / "final")
    for stage, weights in expected.items():
        for name, value in weights.items():
            assert torch.equal(finals[stage][name], value), f"stage {stage} {name} differs after resuming"

    def consolidated(step: int) -> torch.nn.Module:
        output = tmp_path / f"model_{step}.safetensors"
        result = run_cli("consolidate", str(whole / "ckpt" / f"step_{step:08d}"), "-o", str(output))
        assert result.returncode == 0, result.stderr
        spec = load_model_file(REPO / "examples" / "gpt.py")
        spec.module.load_state_dict(load_file(str(output)), strict=True)
        return spec

    last = consolidated(4).module.state_dict()
    for name, value in expected[0].items():  # the consolidated tensors are the whole ones, not a replica's shard
        assert torch.equal(last[name], value), name
    spec = consolidated(3)
    batches = global_batches(spec, 8, 0)
    for _ in range(3):
        next(batches)
    with torch.no_grad():
        loss = eager_loss(spec, *next(batches)).item()
    assert loss == pytest.approx(read_metrics(whole / "metrics.jsonl")[-1]["loss"], rel=1e-6)


@pytest.mark.parametrize(("options", "message"), [
    ({"zero": 3}, r"--zero 3 shards over data-parallel ranks; it needs --dp 2 or more"),
    ({"zero": 2, "dp": 2, "schedule": "zb-h1"}, r"--zero 2 does not run with a zero-bubble schedule"),
    ({"zero": 3, "dp": 2, "schedule": "zbv"}, r"--zero 3 does not run with a zero-bubble schedule"),
    ({"zero": 4, "dp": 2}, r"--zero must be 1, 2 or 3"),
])  # fmt: skip
def test_combinations_that_cannot_run_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        CompileOptions(model=REPO / "examples" / "gpt.py", **options)


def test_plans_from_before_zero_levels_still_load(tmp_path):
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", dp=2, zero=True), out)
    assert plan.zero == 1
    data = plan.to_json()
    for old, level in ((True, 1), (False, 0)):
        data["zero"] = old
        assert Plan.from_json(data).zero == level


def test_cli_zero_alone_is_zero_1_and_a_level_is_taken(tmp_path):
    for flags, level in ((["--zero"], 1), (["--zero", "3"], 3)):
        out = tmp_path / f"out{level}"
        result = run_cli("compile", "examples/gpt.py", "-o", str(out), "--dp", "2", *flags)
        assert result.returncode == 0, result.stderr
        assert Plan.from_json(__import__("json").loads((out / "plan.json").read_text())).zero == level
    result = run_cli("compile", "examples/gpt.py", "-o", str(tmp_path / "bad"), "--dp", "2", "--zero", "5")
    assert result.returncode == 2 and "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
