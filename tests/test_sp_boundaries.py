"""Pipeline boundaries under sequence parallelism: the residual stream crosses as each rank's
slice of the sequence (Megatron-SP), with no all-gather before the send and no scatter after the
receive; the plan records it, the cost and memory models count the slice, and the programs
still train like one process."""

import re

import pytest

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import PlanError
from autopart.ir.placement import REPLICATE
from autopart.ir.plan import Plan
from autopart.ir.plan_difference import first_difference
from autopart.ir.scatter_gather import held_bytes
from autopart.passes.front import boundary_held_bytes, build_front, held_tensors, recompute_blocks
from autopart.passes.recompute import stage_input_bytes
from autopart.solve.sequence import SEQUENCE_DIM, boundary_placement
from autopart.tools.verify import verify
from tests.distributed import FREE_LINKS, REPO

LLAMA = REPO / "examples" / "llama.py"


def _stages(out) -> list[str]:
    return [(out / "stages" / f"stage_{k}.py").read_text() for k in range(len(list((out / "stages").glob("stage_*.py"))))]


def _converted(source: str, names: list[str]) -> list[str]:
    """The lines of ``source`` that define one of ``names`` by a tensor-parallel collective."""
    return [line.strip() for line in source.splitlines() if any(re.search(rf"^\s*{n} = tp\.", line) for n in names)]


@pytest.mark.parametrize("sp", [True, False])
def test_the_residual_stream_crosses_as_each_rank_s_slice(tmp_path, sp):
    plan = autopart.compile(LLAMA, pp=2, tp=2, sp=sp, microbatches=4, device="h100-sxm", dtype="bf16")
    out = autopart.emit(plan, tmp_path / "out")
    (sent,) = plan.stages[0].outputs
    assert plan.stages[1].inputs == plan.stages[0].outputs
    name, meta = sent
    assert meta.split_dim == (SEQUENCE_DIM if sp else None)
    first, second = _stages(out)
    returned = re.search(r"return \((\w+),\)", first).group(1)
    received = re.search(r"def forward\(self, (\w+), target\)", second).group(1)
    assert received == name
    if sp:  # neither gathered whole to be sent nor scattered again where it arrives (the norm reads the slice)
        assert _converted(first, [returned]) == [] and "tp.scatter(" not in second
        assert f"Sends: {name} {tuple(meta.shape)} bfloat16, split 2 ways along dim 1 (one slice per rank)" in first
    else:
        assert "split 2 ways" not in first + second


def test_the_models_count_the_slice_a_rank_holds_and_sends():
    options = CompileOptions(model=LLAMA, pp=2, tp=2, sp=True, microbatches=4, device="h100-sxm", dtype="bf16")
    front = build_front(options, micro_batch_size=2)
    chain = front.chain
    held = boundary_held_bytes(front, 2)
    split_somewhere = False
    for k, boundary in enumerate(chain.boundaries):
        tensors = held_tensors(front, boundary.tensors, k + 1, 2)
        for (name, whole), (_, meta) in zip(boundary.tensors, tensors):
            placed = boundary_placement(front.op_graph, name, 2, True)
            assert meta.split_dim == (None if placed == REPLICATE else SEQUENCE_DIM)
            split_somewhere |= meta.split_dim is not None
        assert held[k] == sum(held_bytes(m, 2) for _, m in tensors) < boundary.nbytes
    assert split_somewhere
    whole = build_front(CompileOptions(model=LLAMA, pp=2, tp=2, sp=False, microbatches=4, device="h100-sxm",
                                       dtype="bf16"), micro_batch_size=2)
    assert boundary_held_bytes(whole, 2) == tuple(b.nbytes for b in whole.chain.boundaries)


def test_a_recomputing_stage_keeps_the_slice_it_received():
    """Selective recompute keeps a stage's arguments for its backward: the received slice and the
    target, on top of what its blocks keep."""
    options = CompileOptions(model=LLAMA, pp=2, tp=2, sp=True, microbatches=4, device="h100-sxm", recompute="selective")
    plan = autopart.compile(LLAMA, pp=2, tp=2, sp=True, microbatches=4, device="h100-sxm", recompute="selective")
    front = build_front(options, micro_batch_size=plan.schedule.micro_batch_size)
    first, last = plan.stages[1].blocks
    _, kept, _ = recompute_blocks(front, ["selective"] * len(front.chain.blocks), tp=2)
    arguments = plan.stages[1].activation_bytes - sum(kept[first : last + 1])
    whole = stage_input_bytes(front.chain, first, last)
    (_, received), = plan.stages[1].inputs
    assert arguments == stage_input_bytes(front.chain, first, last, held=boundary_held_bytes(front, 2))
    assert arguments == whole - received.nbytes // 2  # the other rank's half is not held here


@pytest.mark.multiprocess
def test_slices_cross_a_v_shape_pipeline_and_train_like_one_process(tmp_path):
    """zbv: stage 0 sends its slice to the other rank, stages 1 and 2 hand theirs over in memory on
    one rank, and the gradients come back as slices over the gradient channel."""
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=LLAMA, pp=2, tp=2, microbatches=4, global_batch_size=4, schedule="zbv",
                       device=str(FREE_LINKS)),
        out,
    )  # fmt: skip
    assert plan.sp and len(plan.stages) == 4
    assert all(meta.split_dim == SEQUENCE_DIM for stage in plan.stages[:-1] for _, meta in stage.outputs)
    result = verify(out, steps=2)
    assert result.matches, result.failures


def _plan_json() -> tuple[dict, Plan]:
    plan = autopart.compile(LLAMA, pp=2, tp=2, microbatches=4, device=str(FREE_LINKS))
    assert plan.sp and plan.stages[0].outputs[0][1].split_dim == SEQUENCE_DIM
    return plan.to_json(), plan


def test_a_plan_whose_stages_disagree_on_a_slice_is_refused():
    data, _ = _plan_json()
    data["stages"][1]["inputs"][0][1].pop("split_dim")  # stage 1 would size whole buffers for slices
    with pytest.raises(PlanError, match=r"plan\.stages\[0\]\.outputs differ from plan\.stages\[1\]\.inputs"):
        Plan.from_json(data)
    data["stages"][1]["inputs"][0][1]["split_dim"] = 1
    data["mesh"]["tp"] = 3  # 32 positions do not split 3 ways (the mesh is checked elsewhere; the slice here)
    with pytest.raises(PlanError, match=r"split 3 ways along dim 1, which its shape \[2, 32, 64\] does not divide"):
        Plan.from_json(data)


def test_a_plan_written_before_slices_crossed_stages_is_still_accepted():
    """Its boundaries carry no ``split_dim``; pinned with --plan, the rebuilt plan decides them."""
    data, plan = _plan_json()
    for stage in data["stages"]:
        for _, meta in (*stage["inputs"], *stage["outputs"]):
            meta.pop("split_dim", None)
    older = Plan.from_json(data)
    assert first_difference(older, plan) is None
    data["stages"][0]["rank"] = 1  # anything else still counts
    assert first_difference(Plan.from_json(data), plan)[0] == "plan.stages[0].rank"
