"""Sequence parallelism (Megatron-SP): the layouts and collectives it gives, its activation bytes
against Korthikanti et al.'s formulas, and the programs trained under gloo against one process."""

import re

import pytest
import torch

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.plan import load_plan
from autopart.tools.verify import verify
from tests.distributed import FREE_LINKS, REPO, run_cli_here, run_program
from tests.test_tensor_parallel import train_3d

MEGATRON_LAYERS = '''
import sys
sys.path.insert(0, {models!r})
import megatron_layers as m
m.LAYERS = {layers}
m.SIZE_OF_NORMED = {size_of_normed}
m.SPLIT_QKV = {split_qkv}
from megatron_layers import build_model, init_weights, example_batch, loss_fn
'''


def megatron_layers(path, *, layers: int = 2, size_of_normed: bool = False, split_qkv: bool = False):
    """A model file of tests/models/megatron_layers.py's layers at ``path`` (the module's settings
    all set: the module is imported once per test process)."""
    path.write_text(MEGATRON_LAYERS.format(models=str(REPO / "tests" / "models"), layers=layers,
                                           size_of_normed=size_of_normed, split_qkv=split_qkv))
    return path


def layer_activation_bytes(tmp_path, *, tp: int, sp: bool, size_of_normed: bool = False, recompute: str = "none",
                           split_qkv: bool = False, dtype: str = "fp32") -> int:
    """One layer's activation bytes as the memory model predicts them: a model of three layers
    less the same model of two (everything else is the same in both)."""
    totals = []
    for layers in (2, 3):
        model = megatron_layers(tmp_path / f"layers_{layers}{'_split' if split_qkv else ''}.py", layers=layers,
                                size_of_normed=size_of_normed, split_qkv=split_qkv)
        plan = autopart.compile(model, tp=tp, sp=sp, microbatches=1, micro_batch_size=1, device="h100-sxm",
                                recompute=recompute, dtype=dtype)
        totals.append(sum(stage.activation_bytes for stage in plan.stages))
    return totals[1] - totals[0]


@pytest.mark.parametrize("tp, sp", [(1, False), (8, False), (8, True)])
def test_activation_bytes_per_layer_follow_korthikanti(tmp_path, tp, sp):
    s, b, h, a, t = 2048, 1, 4096, 32, tp  # 16-bit, as tests/models/megatron_layers.py builds it
    formula = {  # REFERENCE.md, Korthikanti et al. Table 2
        (1, False): s * b * h * (34 + 5 * a * s / h),
        (8, False): s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        (8, True): s * b * h * (34 / t + 5 * a * s / (h * t)),
    }[tp, sp]
    assert layer_activation_bytes(tmp_path, tp=tp, sp=sp) == pytest.approx(formula, rel=0.05)


@pytest.mark.parametrize("tp, sp", [(1, False), (8, False), (8, True)])
def test_full_recompute_keeps_each_layer_s_input_alone(tmp_path, tp, sp):
    """Korthikanti et al.'s full recomputation: a layer keeps its 16-bit input, 2sbh, whole on
    every tensor-parallel rank without sequence parallelism and a t-th of it with."""
    s, b, h, t = 2048, 1, 4096, tp
    expected = 2 * s * b * h / (t if sp else 1)
    assert layer_activation_bytes(tmp_path, tp=tp, sp=sp, recompute="full") == pytest.approx(expected, rel=0.01)


def test_a_linear_under_autocast_keeps_the_bf16_copy_of_its_whole_input(tmp_path):
    """Under bf16 autocast a norm's output is fp32 and a column-parallel linear keeps its bf16
    cast copy of it, whole on every rank without SP. q, k and v as three linears keep three copies
    where one QKV linear keeps one: two more bf16 copies of s·b·h a layer, not two fp32 ones."""
    s, b, h = 2048, 1, 4096
    split, fused = (layer_activation_bytes(tmp_path, tp=8, sp=False, split_qkv=qkv, dtype="bf16") for qkv in (True, False))
    assert split - fused == 2 * 2 * s * b * h


def test_a_size_read_off_the_normed_input_keeps_the_regathered_slice(tmp_path):
    """nanoGPT's attention reads ``B, T, C = x.size()`` of its normed input. The generated code
    writes that size as a constant, so the QKV linear still gathers its input again in backward
    and keeps a t-th of it (Megatron-SP): the layer holds what it holds without the size read."""
    model = megatron_layers(tmp_path / "sized.py", size_of_normed=True)
    plan = autopart.compile(model, tp=8, sp=True, microbatches=1, micro_batch_size=1, device="h100-sxm")
    found = collectives((autopart.emit(plan, tmp_path / "out") / "stages" / "stage_0.py").read_text())
    assert found["gathered_linear"] == 2 * 2 + 1, found  # each layer's QKV and MLP input, and the head's
    for folder in ("sized", "plain"):
        (tmp_path / folder).mkdir()
    sized = layer_activation_bytes(tmp_path / "sized", tp=8, sp=True, size_of_normed=True)
    assert sized == layer_activation_bytes(tmp_path / "plain", tp=8, sp=True)


TP_COLLECTIVES = ("all_reduce", "reduce_scatter", "gather_from_sequence", "gather_for_products", "gathered_linear",
                  "copy_to_tp", "copy_weight_to_tp", "copy_for_products")


def collectives(source: str, names: tuple[str, ...] = TP_COLLECTIVES, module: str = "tp") -> dict[str, int]:
    """The calls of ``module.NAME`` a stage program runs, per name: a layer written once as a
    method counts once per call."""
    found = dict.fromkeys(names, 0)
    for method in re.split(r"\n    def ", source)[1:]:
        name = method.split("(", 1)[0]
        calls = 1 if name == "forward" else len(re.findall(rf"self\.{name}\(", source))
        for collective in names:
            found[collective] += calls * len(re.findall(rf"= {module}\.{collective}\(", method))
    return found


@pytest.mark.parametrize("sp", [True, False])
def test_sequence_parallel_turns_all_reduces_into_reduce_scatters(tmp_path, sp):
    model = megatron_layers(tmp_path / "layers.py")
    plan = autopart.compile(model, tp=8, sp=sp, microbatches=1, micro_batch_size=1, device="h100-sxm")
    assert plan.sp is sp
    source = (autopart.emit(plan, tmp_path / "out") / "stages" / "stage_0.py").read_text()
    found = collectives(source)
    if sp:  # per layer: the two row-parallel linears reduce-scatter, the two column-parallel ones gather
        assert found["all_reduce"] == 0, found
        assert found["reduce_scatter"] == 2 * 2, found
        assert found["gathered_linear"] == 2 * 2 + 1, found  # and the head's
        # the norms' weights, read by norms of sequence slices: their partial gradients summed in fp32
        assert found["copy_weight_to_tp"] > 0 and "tp.copy_to_tp(self." not in source, found
    else:
        assert found["reduce_scatter"] == found["gathered_linear"] == found["gather_from_sequence"] == 0, found
        assert found["all_reduce"] == 2 * 2, found


def test_an_input_that_only_products_read_is_gathered_as_they_read_it(tmp_path):
    """q, k and v as three linears (Llama's) share one gather of their normed input. Under bf16
    autocast the norm's output is fp32 and the products read it as bf16, so it is gathered as
    bf16 (``tp.gather_for_products``), as Megatron gathers; in fp32 it is gathered as it is.
    Without SP, the gradient the products send back is summed in bf16 (``tp.copy_for_products``)."""
    model = megatron_layers(tmp_path / "split.py", split_qkv=True)
    for dtype, moved in (("bf16", 2), ("fp32", 0)):
        plan = autopart.compile(model, tp=8, sp=True, microbatches=1, micro_batch_size=1, device="h100-sxm", dtype=dtype)
        source = (autopart.emit(plan, tmp_path / dtype) / "stages" / "stage_0.py").read_text()
        found = collectives(source)
        assert found["gathered_linear"] == 2 + 1, found  # each layer's MLP input, and the head's
        assert found["gather_for_products"] == moved, found  # each layer's q, k and v input
        normed = re.findall(r"= tp\.(gather_for_products|gather_from_sequence)\(layer_norm", source)
        assert normed == ["gather_for_products" if moved else "gather_from_sequence"] * 2, normed  # one per layer written
        plan = autopart.compile(model, tp=8, sp=False, microbatches=1, micro_batch_size=1, device="h100-sxm", dtype=dtype)
        found = collectives((autopart.emit(plan, tmp_path / f"{dtype}-no-sp") / "stages" / "stage_0.py").read_text())
        # without SP: the gradient of q, k and v's input, the MLP's and the head's is summed as they send it
        assert found["copy_for_products"] == (2 * 2 + 1 if moved else 0), found


def test_sequence_parallelism_is_on_by_default_with_tp_and_recorded_in_the_plan(tmp_path):
    model = REPO / "examples" / "gpt.py"
    assert autopart.compile(model, tp=2, microbatches=2, device=str(FREE_LINKS)).sp
    assert not autopart.compile(model, tp=1, microbatches=2, device=str(FREE_LINKS)).sp
    for flag, expected in (("--no-sp", False), ("--sp", True)):  # the command line pins it either way
        out = tmp_path / flag
        result = run_cli_here("compile", str(model), "-o", str(out), "--tp", "2", flag, "--device", str(FREE_LINKS))
        assert result.returncode == 0, result.stderr[-2000:]
        assert load_plan(out / "plan.json").sp is expected


# The examples have no dropout, so the distributed runs draw no random numbers and must equal
# one process exactly. A dropout inside the sequence-split region draws each rank's slice from a
# stream of its own, as Megatron's model-parallel generator does (tests/test_dropout.py).
@pytest.mark.multiprocess
@pytest.mark.parametrize("example", ["gpt", "llama"])
@pytest.mark.parametrize("pp", [1, 2])
def test_sequence_parallel_trains_like_one_process_fp32(tmp_path, example, pp):
    plan, out = train_3d(tmp_path, REPO / "examples" / f"{example}.py", pp=pp, tp=2, dp=1)
    assert plan.sp
    found = collectives("".join(p.read_text() for p in (out / "stages").glob("stage_*.py")))
    assert found["reduce_scatter"], found  # into the sequence split; what comes out of it is the solver's choice


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks", [2, 4])
def test_sequence_parallel_collectives_match_one_process(ranks):
    result = run_program([str(REPO / "tests" / "sp_collectives_rank.py")], ranks, timeout=120)
    assert result.stdout.count("ok") == ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("example", ["gpt", "llama"])
@pytest.mark.parametrize("pp", [1, 2])
def test_sequence_parallel_trains_like_one_process_bf16(tmp_path, example, pp):
    """Llama's plan is priced as on an H100, where gathering a norm's output for q, k and v as the
    bf16 they read (``tp.gather_for_products``) is the layout the solver takes; with free links
    any layout is as good."""
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=REPO / "examples" / f"{example}.py", pp=pp, tp=2, microbatches=2 * pp,
                       global_batch_size=2 * pp, dtype="bf16", device="h100-sxm" if example == "llama" else str(FREE_LINKS)),
        out,
    )  # fmt: skip
    assert plan.sp and plan.dtype == "bf16"
    if example == "llama":
        assert "= tp.gather_for_products(" in "".join(p.read_text() for p in (out / "stages").glob("*.py"))
    result = verify(out, steps=2)
    assert result.matches, result.failures


@pytest.mark.multiprocess
def test_tensor_parallel_without_sp_trains_like_one_process_bf16(tmp_path):
    """Without SP, the gradients that Llama's q, k and v (w1 and w3) send back into their shared
    input are summed over the group in bf16 (``tp.copy_for_products``), as Megatron's f sums them."""
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=REPO / "examples" / "llama.py", tp=2, sp=False, microbatches=2, global_batch_size=2,
                       dtype="bf16", device="h100-sxm"),
        out,
    )  # fmt: skip
    assert not plan.sp and "= tp.copy_for_products(" in (out / "stages" / "stage_0.py").read_text()
    result = verify(out, steps=2)
    assert result.matches, result.failures


@pytest.mark.multiprocess
def test_sequence_parallel_trains_like_one_process_under_a_split_backward(tmp_path):
    """zb-h1 runs each stage's backward as I then W; the gathered head linear computes its
    input's gradient in I and its weight's in W (``autopart.runtime.backward.backward_phase``)."""
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=REPO / "examples" / "llama.py", pp=2, tp=2, microbatches=4, global_batch_size=4,
                       schedule="zb-h1", device=str(FREE_LINKS)),
        out,
    )  # fmt: skip
    assert plan.sp and "tp.gathered_linear(" in "".join(p.read_text() for p in (out / "stages").glob("*.py"))
    result = verify(out, steps=2)
    assert result.matches, result.failures


def test_the_reduce_scatter_goes_by_torch_s_current_name(monkeypatch):
    """torch 2.13 renamed ``reduce_scatter_tensor`` ``reduce_scatter_single`` and warns at every
    call of the old name: each rank of a sequence-parallel plan printed the warning. The runtime
    calls the new name where it exists and the old one on the torch versions before it."""
    import torch.distributed as dist

    from autopart.runtime.collectives import reduce_scatter_into

    called = []
    monkeypatch.setattr(dist, "reduce_scatter_single", lambda out, whole, **kw: called.append("single"), raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda out, whole, **kw: called.append("tensor"))
    reduce_scatter_into(torch.zeros(1), torch.zeros(2), group=None)
    monkeypatch.delattr(dist, "reduce_scatter_single")
    reduce_scatter_into(torch.zeros(1), torch.zeros(2), group=None)
    assert called == ["single", "tensor"]
