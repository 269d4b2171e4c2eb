"""ZeRO-2 and ZeRO-3 (FSDP) train the model that one process trains: the same losses and final
weights with AdamW, over data parallelism alone and with a pipeline, with a tied embedding
across stages, in bf16 as ZeRO-1 does, and with recompute; at ZeRO-3 each layer is an FSDP unit
of its own, whole only while it computes; a checkpoint saved sharded resumes bit for bit and
consolidates into the model's own state dict; and what cannot run together is refused in one line."""

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
from tests.distributed import REPO, assert_same_training, compile_and_train, read_metrics, run_cli_here, run_ranks
from tests.distributed import fork_ranks, gloo_group, stage_weights

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
def test_zero3_per_layer_units_train_llama_with_recompute_like_one_process(tmp_path):
    """Llama's layers read the rope tables of the root unit, and full recompute runs every layer's
    method again in backward, where FSDP gathers the layer once more."""
    run = compile_and_train(tmp_path, "llama", pp=1, microbatches=2, schedule="1f1b", optimizer="adamw", lr=LR,
                            dp=2, zero=3, recompute="full")  # fmt: skip
    assert "layer_methods = {" in (run.out / "stages" / "stage_0.py").read_text()
    # one weight of layers.0 moves 1.5e-5 off the reference, exactly as much as with the stage as
    # one unit and without recompute: a near-zero gradient summed over replicas in another order
    assert_same_training(run, optimizer="adamw", lr=LR, param_atol=3e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("pp", [1, 2], ids=["dp2", "pp2xdp2"])
def test_bf16_zero3_trains_as_bf16_zero1(tmp_path, pp):
    """FSDP gathers bf16 layers from fp32 shards and reduce-scatters fp32 gradients: the precision
    of ZeRO-1's distributed optimizer, so the same losses and fp32 weights up to reduction order."""
    runs = {zero: compile_and_train(tmp_path / f"zero{zero}", "gpt", pp=pp, dp=2, zero=zero, microbatches=2,
                                    schedule="1f1b", dtype="bf16", optimizer="adamw", lr=LR)
            for zero in (1, 3)}  # fmt: skip
    losses = {zero: torch.tensor([m["loss"] for m in run.metrics]) for zero, run in runs.items()}
    torch.testing.assert_close(losses[3], losses[1], rtol=1e-3, atol=1e-3)
    for stage, weights in runs[1].finals.items():
        for name, value in weights.items():
            torch.testing.assert_close(runs[3].finals[stage][name], value, rtol=0, atol=2e-5, msg=name)


@pytest.mark.multiprocess
def test_zero3_checkpoint_resumes_bit_identical_and_consolidates(tmp_path):
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, dp=2, zero=3, microbatches=2,
                                        micro_batch_size=2, schedule="1f1b", optimizer="adamw"), out)  # fmt: skip
    assert "layer_methods = {" in (out / "stages" / "stage_0.py").read_text(), "per-layer FSDP units are checkpointed"

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
        result = run_cli_here("consolidate", str(whole / "ckpt" / f"step_{step:08d}"), "-o", str(output),
                              "--model", str(REPO / "examples" / "gpt.py"))
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


def test_a_torch_without_public_fully_shard_is_told_and_not_searched(monkeypatch):
    """torch 2.4 and 2.5 (which the package allows) have no ``torch.distributed.fsdp.fully_shard``:
    a ZeRO-2/3 plan is refused in one line at compile (and at launch, by the same check) and the
    search leaves those levels out."""
    import torch.distributed.fsdp as fsdp

    from autopart.solve.planner import search_space

    monkeypatch.delattr(fsdp, "fully_shard")
    with pytest.raises(ConfigError, match=r"--zero 3 runs on torch.distributed.fsdp.fully_shard, which torch .* lacks "
                                          r"\(public from torch 2.6\); install torch 2.6 or later, or use --zero 1"):
        CompileOptions(model=REPO / "examples" / "gpt.py", zero=3, dp=2)
    options = CompileOptions(model=REPO / "examples" / "gpt.py", world_size=4, global_batch_size=8)
    assert search_space(options).zero == (0, 1)
    monkeypatch.undo()
    assert search_space(options).zero == (0, 1, 2, 3)


TEMPERED = """
import torch


class Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.layers(x) / self.temperature


def build_model():
    return Tempered()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return torch.nn.functional.cross_entropy(logits, target)
"""


def test_a_model_with_a_scalar_parameter_is_searched_without_fsdp(tmp_path, caplog):
    """FSDP's fully_shard refuses a 0-dim parameter: the search leaves ZeRO 2 and 3 out and says
    why (pinned, they are refused in one line: tests/test_bad_inputs.py)."""
    import autopart

    model = tmp_path / "tempered.py"
    model.write_text(TEMPERED)
    with caplog.at_level("INFO", logger="autopart"):
        plan = autopart.compile(model, world_size=2, dp=2, global_batch_size=8, measure=False, run_finalists=False)
    assert plan.zero in (0, 1)
    assert "the search leaves out ZeRO 2 and 3: FSDP cannot shard the 0-dim parameter 'temperature'" in caplog.text


def test_a_plan_that_shards_a_scalar_parameter_is_refused(tmp_path):
    """--plan: a plan.json edited to ZeRO 3 for a model with a 0-dim parameter is refused at
    compile, as a pinned --zero 3 is, not at launch on every rank."""
    from autopart.ir.errors import PlanError

    model = tmp_path / "tempered.py"
    model.write_text(TEMPERED)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, dp=2, zero=1, global_batch_size=8, measure=False), out)
    plan = out / "plan.json"
    plan.write_text(plan.read_text().replace('"zero": 1', '"zero": 3', 1))
    with pytest.raises(PlanError, match=r"--zero 3 shards parameters with FSDP's fully_shard, which refuses the "
                                        r"0-dim parameter 'temperature'"):
        compile_to_directory(CompileOptions(model=model, plan=plan, measure=False), tmp_path / "again")


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
        result = run_cli_here("compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--dp", "2", *flags)
        assert result.returncode == 0, result.stderr
        assert Plan.from_json(__import__("json").loads((out / "plan.json").read_text())).zero == level
    result = run_cli_here("compile", str(REPO / "examples" / "gpt.py"), "-o", str(tmp_path / "bad"), "--dp", "2",
                          "--zero", "5")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


class _Seen(torch.autograd.Function):
    """The identity, whose backward calls ``seen()``: at a layer's input, as the layer's backward
    ends (before FSDP's post-backward, whose hook sits on the input from before the body)."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.seen()
        return grad, None


def _layer_units(rank: int, port: int, out: Path, folder: Path) -> None:
    """One data-parallel rank of stage 0 at ZeRO-3: its FSDP units; at each layer's call which
    layers are whole and how many parameter bytes are (recorded from inside the body); and as
    each layer's backward ends, which layers are whole and which FSDP has gathered ahead."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from autopart.runtime.fully_sharded import is_sharded, shard_stage
    from autopart.runtime.stage import load_stage

    with gloo_group(rank, port, 2):
        stage = load_stage(out, 0, torch.device("cpu"))
        ((method, paths),) = type(stage).layer_methods.items()
        body, calls = getattr(stage, method), []

        def whole_layers() -> list[str]:
            return [path for path in paths if not any(is_sharded(p) for p in stage.get_submodule(path).parameters())]

        def prefetched() -> list[str]:  # gathered ahead, not yet swapped in: FSDP's own record of it
            return [path for path in paths
                    if stage.get_submodule(path)._get_fsdp_state()._fsdp_param_group._all_gather_result is not None]

        backward: list[list[str]] = []

        def spy(x, *args, **kwargs):  # the body as the generated forward runs it, seen from inside
            whole = [p for p in stage.parameters() if not is_sharded(p)]
            calls.append({"whole_layers": whole_layers(),
                          "whole_bytes": sum(p.numel() * p.element_size() for p in whole)})
            return body(_Seen.apply(x, lambda: backward.append([whole_layers(), prefetched()])), *args, **kwargs)

        setattr(stage, method, spy)
        shard_stage(stage, init_device_mesh("cpu", (2,)), 3)
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(rank))
        (out_,) = stage(tokens)
        out_.float().pow(2).mean().backward()
        units = sorted(name for name, module in stage.named_modules() if isinstance(module, FSDPModule))
        layer_bytes = {path: sum(p.numel() * 4 for p in stage.get_submodule(path).parameters()) for path in paths}
        total = sum(p.numel() * 4 for p in stage.parameters())
        graded = all(is_sharded(p.grad) for p in stage.parameters())
        (folder / f"rank{rank}.json").write_text(json.dumps({
            "units": units, "paths": list(paths), "calls": calls, "layer_bytes": layer_bytes, "total": total,
            "graded": graded, "backward": backward}))  # fmt: skip


@pytest.mark.multiprocess
def test_zero3_makes_each_layer_a_unit_gathered_only_while_it_computes(tmp_path):
    import json

    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, dp=2, zero=3, microbatches=2,
                                        micro_batch_size=2, schedule="1f1b", optimizer="adamw"), out)  # fmt: skip
    assert fork_ranks(_layer_units, 2, out, tmp_path) == [0, 0]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        paths = result["paths"]
        assert len(paths) >= 2 and result["units"] == sorted(["", *paths]), "the stage the root, each layer a unit"
        assert [call["whole_layers"] for call in result["calls"]] == [[path] for path in paths]
        layers = sum(result["layer_bytes"].values())
        root = result["total"] - layers  # the embeddings: whole over the stage's forward
        for call, path in zip(result["calls"], paths):
            assert call["whole_bytes"] == root + result["layer_bytes"][path] < result["total"]
        assert result["graded"], "every gradient reduce-scattered into its shard"
        # as a layer's backward ends it is whole and FSDP has gathered the one before it: the two
        # layers in flight of the memory model (``autopart.predict.memory.LAYERS_IN_FLIGHT``)
        assert result["backward"] == [[[path], paths[k - 1 : k]] for k, path in reversed(list(enumerate(paths)))]


def test_a_layer_whose_tensors_the_forward_also_reads_stays_in_the_root_unit():
    """FSDP would hold ``layers.0.w`` sharded where the forward reads it outside the layer's method."""
    import torch.nn.functional as F
    from torch import fx, nn

    from autopart.codegen.layers import Unit, layer_methods

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 2))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

        def forward(self, x):
            x = F.linear(x, self.layers[0].w)
            x = F.linear(x, self.layers[1].w)
            return x + self.layers[0].w.sum()

    graph = fx.symbolic_trace(Model()).graph
    units = [Unit(method="layer", prefix="layers.0", nodes=("linear",), inputs=("x",), output="linear"),
             Unit(method="layer", prefix="layers.1", nodes=("linear_1",), inputs=("linear",), output="linear_1")]
    assert layer_methods(graph, units) == {"layer": ("layers.1",)}
    assert layer_methods(graph, units[1:]) == {"layer": ("layers.1",)}


def test_fsdp_ranks_update_their_dtensors_with_foreach_ops_and_others_per_tensor():
    """A per-tensor update of DTensors dispatches every elementwise op in Python (a third of the
    GPT example's ZeRO-2 step on a CPU); a foreach one dispatches each op once."""
    from autopart.runtime.optim import make_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    for name in ("adamw", "sgd"):
        assert make_optimizer(name, params, 0.1, fully_sharded=True).defaults["foreach"] is True
        assert make_optimizer(name, params, 0.1).defaults["foreach"] is False  # the reference's arithmetic
