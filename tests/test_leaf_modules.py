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


@pytest.mark.multiprocess
def test_a_leaf_module_from_a_file_beside_the_model_trains(tmp_path):
    """The stages take a --leaf module from the model file compiled, whose imports of files beside
    it work, not from OUT's copy (ModuleNotFoundError: 'layers' on every rank)."""
    from autopart.tools import cli
    from tests.distributed import run_ranks

    (tmp_path / "layers.py").write_text("import torch\n\nclass Block(torch.nn.Module):\n    def __init__(self):\n"
                                        "        super().__init__()\n        self.linear = torch.nn.Linear(8, 8)\n\n"
                                        "    def forward(self, x):\n        return x + torch.tanh(self.linear(x))\n")
    model = tmp_path / "beside.py"
    model.write_text("import torch\nfrom layers import Block\n\ndef build_model():\n    torch.manual_seed(0)\n"
                     "    return torch.nn.Sequential(Block(), Block(), Block())\n"
                     "\ndef example_batch(b):\n    return (torch.randn(b, 8),), None\n"
                     "\ndef loss_fn(out, target):\n    return out.pow(2).mean()\n")  # fmt: skip
    out = tmp_path / "out"
    cli.main(["compile", str(model), "-o", str(out), "--pp", "2", "--microbatches", "2", "--leaf", "Block",
              "--no-measure"])
    assert "step 0 loss" in run_ranks(out, 2, "--steps", "1").stdout
