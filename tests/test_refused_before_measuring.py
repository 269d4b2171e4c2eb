"""A model file that the compile will refuse (or the options' asks of it) is refused right after
its capture, before any of its ops is timed on this machine: timing a large model's every kernel
takes minutes, and a search's finalists run for seconds each, all thrown away by a refusal that the
capture alone could make.

Each case compiles as a user's first compile on this CPU does (measuring on, the op profile cached
per model under ``$AUTOPART_CACHE_DIR/costs``) or into a ``--costs`` file of the user's, and looks
for what the op timing leaves behind: a profile, which a refusal must not have let it write; and,
where the cache starts empty, for the message figures a first compile measures.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.profiling.measure_defaults import NO_MEASURE_ENV
from cost_models.comm_profile import CommProfile, cache_path

LINEAR = """
import torch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))FROZEN


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target, reduction=REDUCTION)
"""
SUMMED = LINEAR.replace("FROZEN", "").replace("REDUCTION", "'sum'")
FROZEN = LINEAR.replace("FROZEN", ".requires_grad_(False)").replace("REDUCTION", "'mean'")
FROZEN_ON_META = FROZEN.replace("    return torch.nn.Sequential(",
                                "    with torch.device('meta'):\n        return torch.nn.Sequential(")
TEMPERED = """
import torch


class Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))  # 0-dim: FSDP refuses to shard it

    def forward(self, x):
        return self.linear(x) / self.temperature


def build_model():
    return Tempered()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""
LAYERED = (Path(__file__).parent / "models" / "tanh_mlp.py").read_text()  # six repeated layers
PROMPTED = """
import torch
from torch import nn


class Prompted(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4).requires_grad_(False)
        self.prompt = nn.Parameter(torch.ones(4))

    def forward(self, idx):
        x = self.emb(idx)  # (B, 3, 4), frozen: takes no gradient
        flat = x.view(x.shape[0], -1)  # (B, 12), taken before the write below: a view of x all the same
        x[:, 0] = self.prompt  # the trained prompt written into the frozen rows, and so into flat
        return flat


def build_model():
    torch.manual_seed(0)
    return Prompted()


def example_batch(batch_size):
    return (torch.randint(0, 10, (batch_size, 3)),), torch.randn(batch_size, 12)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""
SUMS = r"the loss of model\.py sums over the batch \(the loss of two samples is the sum of each one's\), and "
CASES = {  # name -> (model file, compile options, the refusal)
    "summed_loss_in_microbatches": (SUMMED, {"pp": 1, "microbatches": 2},
                                    SUMS + r"the plan splits each batch of 8 into 2 of 4 and averages their losses"),
    "summed_loss_in_replicas": (SUMMED, {"pp": 1, "dp": 2, "microbatches": 1, "global_batch_size": 4},
                                SUMS + r"the plan splits each batch of 4 into 2 of 2"),
    "summed_loss_searched": (SUMMED, {"world_size": 2, "global_batch_size": 4},
                             SUMS + r"the search splits each batch of 4 into microbatches or data-parallel replicas "
                                    r"and averages their losses, .*; make it a mean over the batch \(.*\), or keep "
                                    r"each batch whole with --microbatches 1 --dp 1$"),
    "summed_loss_searched_over_replicas_pinned": (SUMMED, {"world_size": 2, "global_batch_size": 4, "dp": 2},
                                                  SUMS + r"the search splits .*divide by the batch size\)$"),
    "loss_takes_no_gradient": (FROZEN, {"pp": 1, "microbatches": 2},
                               r"the loss of model\.py takes no gradient from any parameter that trains"),
    "scalar_parameter_under_zero3": (TEMPERED, {"pp": 1, "dp": 2, "zero": 3},
                                     r"--zero 3 shards parameters with FSDP's fully_shard, which refuses the 0-dim "
                                     r"parameter 'temperature'; make it a tensor of one element"),
    "stage_layers_of_a_model_without_repeated_layers": (
        FROZEN.replace(".requires_grad_(False)", ""), {"pp": 2, "stage_layers": "1,1"},
        r"--stage-layers counts repeated layers \(a ModuleList of blocks\), and this model has none; drop "),
    "stage_layers_beyond_the_model_s": (LAYERED, {"pp": 2, "stage_layers": "4,4"},
                                        r"--stage-layers sums to 8 layers but the model has 6 \(layers\.0 to "
                                        r"layers\.5\); give counts that sum to 6$"),
    "module_beside_named_as_an_output_file": (
        "from train import WIDTH  # train.py beside the model\n" + FROZEN.replace(".requires_grad_(False)", ""),
        {"pp": 1, "microbatches": 2},
        r"^model\.py imports train\.py from beside it, a name the output directory keeps for its own files; rename "
        r"that module$"),
    "loss_takes_no_gradient_on_the_meta_device": (FROZEN_ON_META, {"pp": 1, "microbatches": 2},
                                                  r"the loss of model\.py takes no gradient from any parameter"),
}


BESIDE = {"module_beside_named_as_an_output_file": {"train.py": "WIDTH = 8\n"}}  # case -> files beside the model


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """This machine's default measuring, on, into an empty cache that already holds the message
    figures (measured once per machine, not per model: not what these tests look for)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(cache))
    monkeypatch.delenv(NO_MEASURE_ENV, raising=False)  # the suite's conftest turns it off
    profile = CommProfile(device="cpu", backend="gloo", ranks=2, host="test", torch_version=torch.__version__,
                          curves={"p2p": [[4, 1e-4], [1 << 20, 1e-3]]}, process_bytes=300 << 20)
    path = cache_path("cpu", "gloo")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile)))
    return cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_model_to_be_refused_has_none_of_its_ops_timed(measuring, tmp_path, case):
    source, options, refusal = CASES[case]
    model = tmp_path / "model.py"
    model.write_text(source)
    for name, text in BESIDE.get(case, {}).items():
        (tmp_path / name).write_text(text)
    try:
        with pytest.raises(autopart.AutopartError, match=refusal):
            autopart.compile(model, **options)
        assert not list(measuring.rglob("costs/*.json"))  # the default path's op profile of this model
        costs = tmp_path / "costs.json"
        with pytest.raises(autopart.AutopartError, match=refusal):
            autopart.compile(model, costs=costs, **options)  # the ops it lacks timed into the user's database
        assert not costs.exists()
    finally:
        for name in BESIDE.get(case, {}):
            sys.modules.pop(name.removesuffix(".py"), None)  # the model file imported it by its plain name


def test_layers_pinned_as_the_model_has_them_compile(tmp_path):
    """The capture's check of --stage-layers refuses no count that the chain of blocks meets,
    and the chain's own check still refuses a count short of the model's layers."""
    model = tmp_path / "model.py"
    model.write_text(LAYERED)
    plan = autopart.compile(model, pp=2, stage_layers="2,4", device="a100-80gb")
    assert len(plan.stages) == 2
    with pytest.raises(autopart.AutopartError, match=r"--stage-layers sums to 5 layers but the model has 6 "):
        autopart.compile(model, pp=2, stage_layers="2,3", device="a100-80gb")


@pytest.mark.parametrize("pins", [{"world_size": 2, "dp": 1}, {"world_size": 1}, {"world_size": 2, "tp": 2}],
                         ids=["dp_1", "world_1", "tp_fills_the_world"])
def test_a_summed_loss_compiles_where_the_search_keeps_the_batch_whole(tmp_path, pins):
    """One microbatch, and dp 1 pinned or left by the pins (the world is one device, or tp fills
    it): nothing the search may choose splits the batch (it refused the last two)."""
    model = tmp_path / "model.py"
    model.write_text(SUMMED)
    plan = autopart.compile(model, global_batch_size=4, microbatches=1, device="a100-80gb", **pins)
    assert plan.mesh["dp"] == 1 and plan.schedule.micro_batch_size == plan.schedule.global_batch_size == 4


@pytest.mark.parametrize("script_test", ['__name__ == "__main__"', "'__main__' == __name__"])
def test_a_module_beside_imported_only_as_a_script_runs_is_not_the_model_s(tmp_path, script_test):
    """``import train`` under ``if __name__ == "__main__":`` (either way round) runs only when the
    file runs as a script: the user's own train.py beside it is not a module the model imports (it
    was refused as one named like an output file), and the output does not carry it."""
    model = tmp_path / "model.py"
    model.write_text(FROZEN.replace(".requires_grad_(False)", "")
                     + f"\nif {script_test}:\n    import train\n\n    train.main()\n")
    (tmp_path / "train.py").write_text("def main():\n    pass\n")
    plan, out = compile_to_directory(CompileOptions(model=model, pp=1, microbatches=2, device="a100-80gb"),
                                     tmp_path / "out")
    assert plan.mesh["pp"] == 1 and "def main():\n    pass" not in (out / "train.py").read_text()


def test_a_gradient_that_only_autograd_follows_is_not_refused(tmp_path):
    """The capture's rule misses the gradient that reaches a view taken before its base was
    written (the loss reads ``flat``, which the rule last saw with none); the forward that
    confirms a refusal finds it, and the model compiles."""
    model = tmp_path / "model.py"
    model.write_text(PROMPTED)
    plan = autopart.compile(model, pp=1, device="a100-80gb")
    assert plan.mesh["pp"] == 1


@pytest.mark.parametrize("source, options, refusal", [
    (FROZEN.replace(".requires_grad_(False)", ""), {"world_size": 2},
     r"^the search needs the global batch: add --global-batch-size B"),
    (FROZEN, {"pp": 1, "microbatches": 2}, r"takes no gradient from any parameter that trains"),
    (SUMMED, {"world_size": 2, "global_batch_size": 4}, r"the search splits each batch of 4 into microbatches"),
], ids=["search_without_its_global_batch", "loss_takes_no_gradient", "search_of_a_summed_loss"])
def test_a_refusal_comes_before_the_messages_are_measured(tmp_path, monkeypatch, source, options, refusal):
    """A first compile on this machine measures its messages between two processes (seconds): a
    search's refusal of its options, and a layout given in full's or a search's of its model, need
    none of it (a search, which times no op before it, measured them before its capture refused)."""
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(NO_MEASURE_ENV, raising=False)
    model = tmp_path / "model.py"
    model.write_text(source)
    with pytest.raises(autopart.AutopartError, match=refusal):
        autopart.compile(model, **options)
    assert not cache_path("cpu", "gloo").exists()


def test_a_plan_of_another_version_of_the_model_is_refused_before_its_ops_are_timed(measuring, tmp_path):
    model = tmp_path / "model.py"
    model.write_text(FROZEN.replace(".requires_grad_(False)", ""))
    autopart.compile(model, pp=1, measure=False).save(tmp_path / "plan.json")
    model.write_text(model.read_text() + "# edited since\n")
    with pytest.raises(autopart.AutopartError, match=r"plan\.json was compiled from another version of model\.py "
                                                     r"\(its model hash differs\); recompile without --plan$"):
        autopart.compile(model, plan=tmp_path / "plan.json")
    assert not list(measuring.rglob("costs/*.json"))


def test_a_plan_of_another_version_of_the_model_is_refused_before_the_messages_are_measured(tmp_path, monkeypatch):
    """The plan's model hash is read from the file alone: on a machine whose messages were never
    measured it was compared after they were (seconds of two processes)."""
    model = tmp_path / "model.py"
    model.write_text(FROZEN.replace(".requires_grad_(False)", ""))
    autopart.compile(model, pp=1, measure=False).save(tmp_path / "plan.json")
    model.write_text(model.read_text() + "# edited since\n")
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(NO_MEASURE_ENV, raising=False)
    with pytest.raises(autopart.AutopartError, match=r"was compiled from another version of model\.py"):
        autopart.compile(model, plan=tmp_path / "plan.json")
    assert not cache_path("cpu", "gloo").exists()


def test_a_plan_s_refusal_of_the_model_comes_before_the_messages_are_measured(tmp_path, monkeypatch):
    """A plan that splits the batch of a model whose loss sums over it: refused by the capture,
    which a --plan compile made after it measured the messages (it times no op before)."""
    model = tmp_path / "model.py"
    model.write_text(SUMMED)
    autopart.compile(model, pp=1, microbatches=1, measure=False).save(tmp_path / "plan.json")
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["schedule"].update(microbatches=2, micro_batch_size=4)  # the batch of 8 in two
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(NO_MEASURE_ENV, raising=False)
    with pytest.raises(autopart.AutopartError, match=r"the plan splits each batch of 8 into 2 of 4"):
        autopart.compile(model, plan=tmp_path / "plan.json")
    assert not cache_path("cpu", "gloo").exists()
