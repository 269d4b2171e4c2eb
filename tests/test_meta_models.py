"""A model built on the meta device is captured, costed on fake tensors, solved and emitted
without its weights; its programs make each stage's weights on the rank that holds them, with the
model's own initialisers, or read them by name from a safetensors checkpoint."""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from autopart.ir.errors import ConfigError, ModelFileError
from autopart.ir.model_file import is_meta, load_model_file
from autopart.passes.capture import capture
from autopart.profiling import profile
from autopart.profiling.profile import made_to_time
from autopart.driver import CompileOptions, compile_to_directory
from autopart.runtime.materialise import materialise, meta_names
from tests.distributed import REPO, assert_same_training, compile_and_train

MODEL = REPO / "tests" / "models" / "meta_lm.py"


def test_each_module_is_made_alike_whatever_else_a_process_makes():
    spec = load_model_file(MODEL)
    everything = materialise(spec.module, meta_names(spec.module), init=spec.init_weights)
    other = load_model_file(MODEL)  # another process
    alone = materialise(other.module, ["blocks.2.gate.scale", "head.weight"], init=other.init_weights)
    assert torch.equal(alone["blocks.2.gate.scale"], everything["blocks.2.gate.scale"])
    assert torch.equal(alone["head.weight"], everything["embed.weight"]), "a tied tensor is made once"
    assert spec.module.head.weight is spec.module.embed.weight, "materialising keeps ties"
    assert not torch.equal(everything["blocks.0.up.weight"], everything["blocks.1.up.weight"])


def test_meta_model_compiles_without_weights(tmp_path):
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=MODEL, pp=2, microbatches=2, micro_batch_size=2), out)
    assert len(plan.stages) == 2
    written = [load_file(str(p)) for p in (out / "weights").glob("*.safetensors")]
    assert written and not any(written), "no values to write: each rank makes its weights"
    assert all(s.activation_bytes > 0 for s in plan.stages), "saved bytes measured on fake tensors"
    assert sum(s.parameter_bytes for s in plan.stages) >= (64 * 32 + 4 * (2 * 32 * 64 + 4 * 32)) * 4


@pytest.mark.multiprocess
def test_meta_model_trains_from_its_initialisers(tmp_path):
    run = compile_and_train(tmp_path, MODEL, pp=2, microbatches=2, schedule="1f1b")
    assert run.plan.tied_parameters == {"embed.weight": (0, 1)}
    assert_same_training(run, optimizer="sgd", lr=0.1)


@pytest.mark.multiprocess
def test_meta_model_trains_from_a_checkpoint(tmp_path):
    model = load_model_file(MODEL).module
    generator = torch.Generator().manual_seed(99)
    # one entry per tensor: a tied weight is saved once, under its first name (embed.weight)
    checkpoint = {name: torch.randn(tuple(t.shape), generator=generator) * 0.1 for name, t in model.named_parameters()}
    path = tmp_path / "init.safetensors"
    save_file(checkpoint, str(path))
    run = compile_and_train(
        tmp_path, MODEL, pp=2, microbatches=2, schedule="1f1b", train_args=("--weights", str(path))
    )
    assert_same_training(run, optimizer="sgd", lr=0.1, weights=path)
    torch.testing.assert_close(run.finals[0]["blocks.0.up.weight"], checkpoint["blocks.0.up.weight"], atol=0.05, rtol=0)


_INIT_MODEL = '''
import torch
from torch import nn

DEVICE = "{device}"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)  # kaiming_uniform_ and uniform_ in its reset_parameters
        self.embed = nn.Embedding(16, 8)  # normal_
        {extra}


def build_model():
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return Net()


def example_batch(batch_size):
    return (torch.zeros(batch_size, 8),), None
'''


def _init_model(tmp_path, device: str, extra: str = ""):
    path = tmp_path / f"init_{device}.py"
    path.write_text(_INIT_MODEL.format(device=device, extra=extra))
    return path


def test_building_on_meta_runs_no_random_fill_and_a_real_model_is_built_as_without_autopart(tmp_path, monkeypatch):
    # on the meta device each fill runs torch's Python reference (seconds for a thousand layers) and fills nothing
    fills = []
    real_normal, real_uniform = torch.Tensor.normal_, torch.Tensor.uniform_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda t, *a, **k: fills.append("normal_") or real_normal(t, *a, **k))
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda t, *a, **k: fills.append("uniform_") or real_uniform(t, *a, **k))
    meta = load_model_file(_init_model(tmp_path, "meta")).module
    assert fills == [] and meta.up.weight.is_meta and meta.up.weight.shape == (8, 8)
    real = load_model_file(_init_model(tmp_path, "cpu")).module
    assert sorted(set(fills)) == ["normal_", "uniform_"]
    torch.manual_seed(0)
    from importlib import util

    spec = util.spec_from_file_location("plain", _init_model(tmp_path, "cpu"))
    plain = util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    expected = plain.build_model().state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in real.state_dict().items())


def test_an_initialiser_that_refuses_its_meta_tensor_still_refuses_it(tmp_path):
    path = _init_model(tmp_path, "meta", "nn.init.kaiming_uniform_(nn.Parameter(torch.empty(8)))")
    with pytest.raises(ModelFileError, match="Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"):
        load_model_file(path)


def test_a_meta_model_is_timed_on_the_weights_its_initialisers_make(monkeypatch):
    """The captured graph's owners are plain modules that ``init_weights`` does not recognise: the
    weights come from the model made as a rank makes it, not from uninitialised memory."""
    spec = load_model_file(MODEL)
    graph = capture(spec, batch_size=2)
    made = made_to_time(graph.module, spec)
    expected = materialise(copy.deepcopy(spec.module), meta_names(spec.module), init=spec.init_weights)
    named = dict(made.named_parameters(remove_duplicate=False))
    gate = next(name for name in named if name.endswith("gate.scale"))
    assert named[gate].abs().max() > 0 and torch.equal(named[gate], expected[gate])
    assert all(torch.equal(value, expected[name]) for name, value in named.items() if name in expected)
    assert not is_meta(made) and is_meta(graph.module), "the graph the compile reads stays on meta"

    monkeypatch.setattr(profile, "physical_memory_bytes", lambda: 1 << 10)
    with pytest.raises(ConfigError, match="GiB of weights, more than this machine can make"):
        made_to_time(graph.module, spec)


def test_a_meta_model_s_stages_declare_each_tensor_parallel_slice_as_the_real_one_is_cut(tmp_path):
    # its tensors' slices are made once per shape (its layers' are alike); each declaration must
    # still be the slice of its own tensor that TP rank 0 holds
    import importlib.util

    from autopart.ir.placement import Placement
    from autopart.runtime.shards import shard_weight

    wide = tmp_path / "wide_meta_lm.py"  # wide enough that a GPU's plan cuts its weights
    wide.write_text(MODEL.read_text().replace("VOCAB, SEQ, DIM, LAYERS = 64, 8, 32, 4",
                                              "VOCAB, SEQ, DIM, LAYERS = 2048, 128, 1024, 4"))
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=wide, pp=2, tp=2, microbatches=2, micro_batch_size=2,
                                                  device="a100-80gb"), out)
    spec = load_model_file(wide)
    real = materialise(spec.module, meta_names(spec.module), init=spec.init_weights)
    sliced = 0
    for stage in plan.stages:
        module_spec = importlib.util.spec_from_file_location(f"stage_{stage.index}", out / "stages" / f"stage_{stage.index}.py")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        for name, (shape, dtype) in module.PARAMETERS.items():
            placement = Placement.parse(stage.parameter_placements.get(name, "R"))
            expected = shard_weight(real[name], placement, 2, 0)
            assert (shape, dtype) == (tuple(expected.shape), expected.dtype), name
            sliced += placement.kind == "S"
    assert sliced >= 4, "tensor parallelism cut some weights"


_ROPE_MODEL = '''
import math
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)
        angles = torch.outer(torch.arange(4).float(), torch.ones(2))  # (T, hs/2): on meta, shapes alone
        self.register_buffer("cos", angles.cos(), persistent=False)
        {extra}

    def forward(self, x):  # (B, 4, 2)
        return (self.down(torch.tanh(self.up(x.flatten(1)))).view(-1, 4, 2) * self.cos).pow(2).mean()


def build_model():
    with torch.device("meta"):
        return Net()


def init_weights(module):
    if isinstance(module, nn.Linear):
        module.reset_parameters()
    {init}


def example_batch(batch_size):
    return (torch.randn(batch_size, 4, 2),), None
'''


def _rope_model(tmp_path, extra: str = "", init: str = ""):
    path = tmp_path / "rope.py"
    path.write_text(_ROPE_MODEL.format(extra=extra, init=init))
    return path


def test_a_buffer_its_initialiser_leaves_without_values_is_refused_at_compile_time(tmp_path):
    """A buffer computed in __init__ is on the meta device too: each rank made it of torch.empty's
    memory, and a Llama with its rotary tables made so trained to NaN losses."""
    options = CompileOptions(model=_rope_model(tmp_path), pp=2, microbatches=2, measure=False)
    with pytest.raises(ConfigError, match=r"the model is built on the meta device, and init_weights\(module\) leaves "
                                          r"buffer 'cos' of module '' \(Net\) without values; set it there for that "
                                          r"module, or compute it in forward"):  # fmt: skip
        compile_to_directory(options, tmp_path / "out")
    made = _rope_model(tmp_path, init="if isinstance(module, Net):\n        module.cos.copy_(torch.ones(4, 2))")
    plan, _ = compile_to_directory(CompileOptions(model=made, pp=2, microbatches=2, measure=False), tmp_path / "made")
    assert len(plan.stages) == 2


def test_a_parameter_its_initialiser_leaves_without_values_is_refused_where_it_is_made(tmp_path):
    spec = load_model_file(_rope_model(tmp_path, extra="self.scale = nn.Parameter(torch.ones(8))",
                                       init="if isinstance(module, Net):\n        module.cos.fill_(1.0)"))
    with pytest.raises(ConfigError, match=r"leaves parameter 'scale' of module '' \(Net\) without values; set it there "
                                          r"for that module$"):  # fmt: skip
        materialise(copy.deepcopy(spec.module), ["scale"], init=spec.init_weights)


@pytest.mark.multiprocess
def test_a_meta_model_that_imports_a_file_beside_it_trains(tmp_path):
    """Each rank makes its weights from the model file compiled, whose imports of files beside it
    work, not from OUT's copy (ModuleNotFoundError: 'layers' on every rank)."""
    from autopart.tools import cli
    from tests.distributed import run_ranks
    from tests.tiny_models import beside_model

    model = beside_model(tmp_path, meta=True)
    out = tmp_path / "out"
    cli.main(["compile", str(model), "-o", str(out), "--pp", "2", "--microbatches", "2", "--no-measure"])
    assert "step 0 loss" in run_ranks(out, 2, "--steps", "1").stdout
