"""Tensor and data parallelism: the solver's layouts, and the 3D programs trained under torchrun
against the single-process reference."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.runtime.reference import train_reference
from autopart.runtime.shards import load_stage_weights
from tests.distributed import FREE_LINKS, REPO, environment, free_port, read_metrics, run_ranks

STEPS = 2


def train_3d(tmp_path: Path, example: Path, *, pp: int, tp: int, dp: int, zero: bool = False, optimizer="sgd", lr=0.1,
             atol: float = 1e-6):
    out = tmp_path / "out"
    microbatches = 2 * pp
    plan, _ = compile_to_directory(
        CompileOptions(model=example, pp=pp, tp=tp, dp=dp, zero=zero, microbatches=microbatches,
                       global_batch_size=microbatches * dp, optimizer=optimizer, device=str(FREE_LINKS)),
        out,
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, pp * tp * dp, "--steps", str(STEPS), "--lr", str(lr), "--optimizer", optimizer,
             "--metrics", str(metrics), "--save-weights", str(tmp_path / "final"), timeout=400)
    reference = train_reference(out, steps=STEPS, lr=lr, optimizer=optimizer)
    losses = [m["loss"] for m in read_metrics(metrics)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
    finals = load_stage_weights(plan, tmp_path / "final")
    for weights in finals.values():
        for name, value in weights.items():
            torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=atol, msg=name)
    for name, holders in plan.tied_parameters.items():
        assert all(torch.equal(finals[s][name], finals[holders[0]][name]) for s in holders)
    return plan, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("example", ["gpt", "llama"])
@pytest.mark.parametrize("pp, tp, dp", [(1, 2, 1), (1, 4, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)])
def test_3d_parallel_trains_like_one_process(tmp_path, example, pp, tp, dp):
    plan, _ = train_3d(tmp_path, REPO / "examples" / f"{example}.py", pp=pp, tp=tp, dp=dp)
    assert plan.mesh == {"pp": pp, "tp": tp, "dp": dp}
    if tp > 1:
        assert any(stage.parameter_placements for stage in plan.stages), "some weight is sharded"
        head = {"gpt": "wte.weight", "llama": "output.weight"}[example]  # tied in gpt, not in llama
        assert {s.parameter_placements.get(head) for s in plan.stages if head in s.parameters} == {"S(0)"}


@pytest.mark.multiprocess
def test_zero1_with_adamw_trains_like_one_process(tmp_path):
    # The key third of each c_attn bias has no gradient but rounding (softmax ignores a shift of
    # every key's score), and AdamW scales that noise up to steps of its own size: two of its
    # entries ended 1.4e-6 from one process's on one CPU, the rest within 1e-6.
    train_3d(tmp_path, REPO / "examples" / "gpt.py", pp=1, tp=1, dp=2, zero=True, optimizer="adamw", lr=1e-3, atol=5e-6)


GPT_BLOCK = '''
import sys
sys.path.insert(0, {examples!r})
import gpt
gpt.CONFIG = gpt.GPTConfig(vocab_size=1024, block_size=128, n_layer=2, n_head=12, n_embd=768)
build_model, example_batch, loss_fn = gpt.build_model, gpt.example_batch, gpt.loss_fn
'''


def test_megatron_layout_is_chosen_for_a_gpt_block(tmp_path):  # without sequence parallelism: its all-reduces
    model = tmp_path / "gpt_block.py"
    model.write_text(GPT_BLOCK.format(examples=str(REPO / "examples")))
    plan = autopart.compile(model, tp=2, sp=False, microbatches=1, micro_batch_size=2, device="h100-sxm")
    placements = plan.stages[0].parameter_placements
    for layer in range(2):
        assert placements[f"h.{layer}.attn.c_attn.weight"] == "S(0,3)"  # column-parallel fused QKV: q, k, v slices
        assert placements[f"h.{layer}.mlp.c_fc.weight"] == "S(0)"  # column-parallel
        assert placements[f"h.{layer}.attn.c_proj.weight"] == "S(1)"  # row-parallel
        assert placements[f"h.{layer}.mlp.c_proj.weight"] == "S(1)"  # row-parallel
    out = autopart.emit(plan, tmp_path / "out")
    source = (out / "stages" / "stage_0.py").read_text()
    assert "x = self.block(x, self.h[0])" in source and "x = self.block(x, self.h[1])" in source  # one layer's code
    section = source.split("    def block(self, x, layer):")[1].split("\nSTAGE")[0]
    assert len(re.findall(r"= tp\.all_reduce\(", section)) == 2, section  # forward: after each row-parallel linear
    assert len(re.findall(r"= tp\.copy_to_tp\(", section)) == 2  # backward: before each column-parallel linear
    assert len(re.findall(r"\.view\(2, 128, 6, 64\)", section)) == 3  # q, k, v with 12 / 2 = 6 local heads
    assert "[2, 128, 1536] float32" in section  # the shape comments: the local MLP width, 4 * 768 / 2


@pytest.mark.multiprocess
def test_what_cannot_be_split_stays_replicated(tmp_path):
    plan, out = train_3d(tmp_path, REPO / "tests" / "models" / "odd_gpt.py", pp=1, tp=2, dp=1)
    placements = plan.stages[0].parameter_placements
    assert "h.0.attn.c_attn.weight" not in placements  # 3 heads of 15 do not split in two
    assert placements.get("h.0.mlp.c_fc.weight") == "S(0)"  # the 180-wide MLP does
    assert ".view(" in (out / "stages" / "stage_0.py").read_text()


@pytest.mark.multiprocess
def test_two_nodes_with_tensor_parallelism_inside_each(tmp_path):
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, tp=2, microbatches=4, global_batch_size=4,
                       gpus_per_node=2, device="h100-sxm"),
        out,
    )  # fmt: skip
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=autopart-test",
        str(out / "train.py"), "--steps", str(STEPS), "--lr", "0.1", "--optimizer", "sgd", "--timeout", "120",
        "--metrics", str(tmp_path / "metrics.jsonl"), "--save-weights", str(tmp_path / "final"),
    ]  # fmt: skip
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
             for _ in range(2)]  # fmt: skip
    try:
        logs = [node.communicate(timeout=400)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), "\n".join(log[-3000:] for log in logs)
    reference = train_reference(out, steps=STEPS, lr=0.1, optimizer="sgd")
    losses = [m["loss"] for m in read_metrics(tmp_path / "metrics.jsonl")]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
    for weights in load_stage_weights(plan, tmp_path / "final").values():
        for name, value in weights.items():
            torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=1e-6, msg=name)
