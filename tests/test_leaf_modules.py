"""``--leaf CLASS`` keeps a module class whole: the graph calls it (call_module), the stage that
runs it owns it, built from the model file, and training is unchanged."""

import pytest

from autopart.ir.model_file import load_model_file
from autopart.passes.capture import capture
from tests.distributed import REPO
from tests.distributed import assert_same_training, compile_and_train

LLAMA = REPO / "examples" / "llama.py"


def test_leaf_modules_are_call_module_nodes():
    graph = capture(load_model_file(LLAMA), leaves=("FeedForward",))
    calls = [str(n.target) for n in graph.module.graph.nodes if n.op == "call_module"]
    assert calls == [f"layers.{i}.feed_forward" for i in range(4)]
    assert not any("feed_forward" in str(n.target) for n in graph.module.graph.nodes if n.op == "get_attr")


@pytest.mark.multiprocess
def test_leaf_modules_train_like_one_process(tmp_path):
    run = compile_and_train(
        tmp_path, LLAMA, pp=2, microbatches=2, schedule="1f1b", leaf=("FeedForward",)
    )
    sources = "".join((run.out / "stages" / f"stage_{s}.py").read_text() for s in range(2))
    assert "LEAVES = {" in sources and "'layers.0.feed_forward': 'FeedForward'" in sources
    assert "feed_forward(" in sources
    held = {p for s in run.plan.stages for p in s.parameters}
    assert {f"layers.{i}.feed_forward.w{j}.weight" for i in range(4) for j in (1, 2, 3)} <= held
    assert_same_training(run, optimizer="sgd", lr=0.1)
