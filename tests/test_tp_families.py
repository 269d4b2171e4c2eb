"""Tensor parallelism in every Transformer family users bring: Megatron's layout is found in bf16
as in fp32, through fx and torch.export captures, and the split programs train like one process."""

import logging
from pathlib import Path

import pytest

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.tools.verify import verify
from tests.distributed import REPO
from tests.test_tensor_parallel import train_3d

MODELS = REPO / "tests" / "models"

# Per family, the placement of each weight (by the end of its name): column-parallel S(0) (S(1) for
# a Conv1D, whose weight is (in, out)), row-parallel S(1) (S(0) for a Conv1D), a fused QKV's three
# groups S(0,3) / S(1,3), and the head split over the vocabulary.
MEGATRON = {
    "gpt": {"attn.c_attn.weight": "S(0,3)", "attn.c_proj.weight": "S(1)", "mlp.c_fc.weight": "S(0)",
            "mlp.c_proj.weight": "S(1)", "wte.weight": "S(0)"},
    "llama": {"attention.wq.weight": "S(0)", "attention.wk.weight": "S(0)", "attention.wv.weight": "S(0)",
              "attention.wo.weight": "S(1)", "feed_forward.w1.weight": "S(0)", "feed_forward.w3.weight": "S(0)",
              "feed_forward.w2.weight": "S(1)", "output.weight": "S(0)"},
    "plain_gpt": {"qkv.weight": "S(0,3)", "proj.weight": "S(1)", "fc1.weight": "S(0)", "fc2.weight": "S(1)",
                  "wte.weight": "S(0)"},
    "untraceable_gpt": {"qkv.weight": "S(0,3)", "proj.weight": "S(1)", "fc1.weight": "S(0)", "fc2.weight": "S(1)",
                        "head.weight": "S(0)"},
    "hf_gpt2": {"attn.c_attn.weight": "S(1,3)", "attn.c_proj.weight": "S(0)", "mlp.c_fc.weight": "S(1)",
                "mlp.c_proj.weight": "S(0)", "lm_head.weight": "S(0)"},
    "hf_llama": {"q_proj.weight": "S(0)", "k_proj.weight": "S(0)", "v_proj.weight": "S(0)", "o_proj.weight": "S(1)",
                 "gate_proj.weight": "S(0)", "up_proj.weight": "S(0)", "down_proj.weight": "S(1)",
                 "lm_head.weight": "S(0)"},
}  # fmt: skip
CAPTURE = {"untraceable_gpt": "export", "hf_gpt2": "export", "hf_llama": "export"}


def model_file(folder: Path, family: str, **sizes) -> Path:
    path = folder / f"{family}.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(MODELS)!r})\nfrom families import family\n"
        f"_model = family({family!r}, **{sizes!r})\n"
        "build_model, example_batch, loss_fn = _model.build_model, _model.example_batch, _model.loss_fn\n"
        "init_weights = _model.init_weights\n"
    )
    return path


def placements(plan) -> dict[str, str]:
    found = {name: "R" for stage in plan.stages for name in stage.parameters}
    for stage in plan.stages:
        found.update(stage.parameter_placements)
    return found


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("family", list(MEGATRON))
def test_megatron_layout_in_bf16_as_in_fp32(tmp_path, family, tp):
    # wide enough that matmuls, not kernel launches, decide: on the meta device, nothing is allocated
    model = model_file(tmp_path, family, vocab=32768, seq=1024, width=2048, heads=16, kv_heads=8, layers=1, meta=True)
    plans = {dtype: autopart.compile(model, tp=tp, micro_batch_size=1, device="h100-sxm", dtype=dtype)
             for dtype in ("fp32", "bf16")}  # fmt: skip
    assert plans["fp32"].provenance.capture == CAPTURE.get(family, "fx")
    fp32, bf16 = placements(plans["fp32"]), placements(plans["bf16"])
    assert bf16 == fp32
    for suffix, expected in MEGATRON[family].items():
        named = {name: placement for name, placement in fp32.items() if name.endswith(suffix)}
        assert named and set(named.values()) == {expected}, (suffix, named)


ODD_MLP = """
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))  # no width divides by 2

def example_batch(batch_size):
    return (torch.randn(batch_size, 7),), torch.randn(batch_size, 3)

def loss_fn(output, target):
    return ((output - target) ** 2).mean()
"""


def test_a_tp_that_splits_nothing_says_so(tmp_path, caplog):
    model = tmp_path / "odd_mlp.py"
    model.write_text(ODD_MLP)
    with caplog.at_level(logging.INFO, logger="autopart"):
        plan = autopart.compile(model, tp=2, microbatches=1, micro_batch_size=3, device="h100-sxm")
    assert set(placements(plan).values()) == {"R"}
    notes = [r.getMessage() for r in caplog.records if r.name == "autopart"]
    assert notes == [
        "--tp 2 splits no weight of odd_mlp.py: none divides 2 ways, or splitting would be slower than running it "
        "whole; each of the 2 ranks holds and computes the whole model (lower --tp, or use --pp or --dp)"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="autopart"):
        autopart.compile(model_file(tmp_path, "gpt", width=64, heads=4, layers=1), tp=2, micro_batch_size=2,
                         device=str(REPO / "tests" / "devices" / "free-links.toml"))  # fmt: skip
    assert not [r for r in caplog.records if r.name == "autopart"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("family, pp", [("untraceable_gpt", 2), ("hf_gpt2", 1), ("hf_llama", 1)])
def test_exported_families_split_and_train_like_one_process(tmp_path, family, pp):
    model = model_file(tmp_path, family, vocab=256, seq=16, width=64, heads=8, kv_heads=4, layers=2)
    plan, _ = train_3d(tmp_path, model, pp=pp, tp=2, dp=1)  # same losses and weights as one process
    assert plan.provenance.capture == "export"
    split = [name for name, placement in placements(plan).items() if placement.startswith("S")]
    assert len(split) >= 8, split  # the layers' matrices and the head, not a replicated copy


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_vocabulary_parallel_head_in_bf16_verifies(tmp_path, family):
    out = tmp_path / "out"
    model = model_file(tmp_path, family, vocab=512, seq=16, width=64, heads=4, kv_heads=2, layers=2)
    plan, _ = compile_to_directory(
        CompileOptions(model=model, pp=2, tp=2, microbatches=4, global_batch_size=8, dtype="bf16",
                                device=str(REPO / "tests" / "devices" / "free-links.toml")),
        out,
    )  # fmt: skip
    head = "wte.weight" if family == "gpt" else "output.weight"
    assert placements(plan)[head] == "S(0)"  # tied (gpt) or not (llama), split over the vocabulary
    result = verify(out, steps=3)
    assert result.matches, result.failures
