"""Every plan that a pin can produce emits: each example at tp 8, bf16 and fp32, interleaved and
zero-bubble, compiles to an output directory with a stage program per stage."""

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from tests.distributed import REPO

EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.py") if "def build_model" in p.read_text())  # not scripts


@pytest.mark.parametrize("schedule, chunks", [("interleaved", 2), ("zb-h1", 1)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.stem)
def test_every_example_emits_at_tp8(tmp_path, example, dtype, schedule, chunks):
    options = CompileOptions(model=example, pp=2, tp=8, chunks=chunks, schedule=schedule, microbatches=4,
                             micro_batch_size=1, dtype=dtype, device="h100-sxm")  # fmt: skip
    plan, out = compile_to_directory(options, tmp_path / "out")
    assert plan.mesh == {"pp": 2, "tp": 8, "dp": 1}
    assert len(plan.stages) == 2 * chunks
    for stage in plan.stages:
        source = (out / "stages" / f"stage_{stage.index}.py").read_text()
        compile(source, f"stage_{stage.index}.py", "exec")  # what each rank will import


def test_emitting_with_the_front_s_blocks_writes_what_cutting_them_again_writes(tmp_path):
    from autopart.codegen.emit import emit_directory
    from autopart.driver import compile_plan

    options = CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, tp=2, microbatches=4, micro_batch_size=1,
                             device="h100-sxm")
    plan, front = compile_plan(options)
    given = emit_directory(plan, front.op_graph, front.spec, tmp_path / "out_a", chain=front.chain)
    cut = emit_directory(plan, front.op_graph, front.spec, tmp_path / "out_b")
    # the programs (their headers name their folder; the hashes of plan.json and the weights differ with them)
    files = sorted(p.relative_to(cut) for p in (*cut.glob("stages/*.py"), cut / "train.py", cut / "report.md"))
    assert len(files) == 4
    for name in files:
        assert (given / name).read_text().replace("out_a", "out_b") == (cut / name).read_text(), name
