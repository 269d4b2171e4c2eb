"""A model that draws random numbers (dropout in training mode) compiles, and its programs draw
from a seed of train.py's ``--seed`` and the forward's step, replica, microbatch and stage
(`autopart.runtime.draws.draw_seed`): a rerun draws the same, a recomputing stage draws what one
that keeps its activations draws, every tensor-parallel rank draws alike but for a dropout of a
split tensor (a stream per rank), and a plan of one stage, microbatch and rank draws what the
single-process reference draws. Held-out losses are computed without dropout."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.model_file import load_model_file
from autopart.ir.plan import load_plan
from autopart.passes.capture import capture
from autopart.runtime.forward import NoDropout
from autopart.runtime.reference import train_reference
from autopart.tools.verify import verify
from autopart.runtime import collectives
from tests.distributed import (FREE_LINKS, REPO, assert_same_training, compile_and_train, gloo_group, read_metrics,
                               fork_ranks, run_cli, run_ranks, train_whole_and_resumed)

MODEL = REPO / "tests" / "models" / "dropout_gpt.py"


def _losses(run) -> list[float]:
    return [m["loss"] for m in run.metrics]


def test_a_model_with_dropout_is_captured_and_the_callers_generator_is_left_as_it_was():
    """The capture checks the graph's loss against the model's from one seed: with dropout the two
    drew different masks and the compile refused the model."""
    spec = load_model_file(MODEL)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    graph = capture(spec, batch_size=2)
    assert graph.module is not None
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.multiprocess
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_one_stage_with_a_split_backward_and_recompute_draws_what_one_process_draws(tmp_path, recompute):
    run = compile_and_train(tmp_path, MODEL, pp=1, microbatches=1, schedule="zb-h1", recompute=recompute)
    assert run.plan.stages[0].recompute == recompute
    assert_same_training(run, optimizer="sgd", lr=0.1)


@pytest.mark.multiprocess
def test_tensor_parallel_ranks_draw_alike(tmp_path):
    """The dropouts after the row-parallel products act on replicated activations: ranks that drew
    apart would hold two different residual streams, and the losses would leave one process's."""
    losses, out = _tensor_parallel_losses(tmp_path, sp=False, microbatches=1)
    assert load_plan(out / "plan.json").mesh["tp"] == 2
    reference = train_reference(out, steps=3, lr=0.1, optimizer="sgd")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_a_pipeline_draws_the_same_with_recompute_and_again_when_rerun(tmp_path):
    """Fresh processes (torchrun's), each drawing from a generator in a state of its own making
    without the seed; the suite's forking launcher would hand every run the same state (the
    recomputing run goes through it: its generator's state before the seed is another again).

    The cuts are pinned: each stage draws from a stream of its own, so a block that moves to the
    other stage draws other numbers, and the cut solver's choice between near-equal cuts follows
    the profile measured at the time (an unpinned compile once cut a block later and failed here)."""
    same = dict(pp=2, microbatches=2, schedule="1f1b", stage_layers=(2, 2))
    kept = compile_and_train(tmp_path / "kept", MODEL, launcher="torchrun", **same)
    rebuilt = compile_and_train(tmp_path / "rebuilt", MODEL, recompute="full", **same)
    again = compile_and_train(tmp_path / "again", MODEL, launcher="torchrun", **same)
    assert [s.blocks for s in rebuilt.plan.stages] == [s.blocks for s in kept.plan.stages]
    assert _losses(rebuilt) == pytest.approx(_losses(kept), rel=1e-6)
    assert _losses(again) == _losses(kept)


@pytest.mark.multiprocess
def test_a_resumed_run_draws_what_the_whole_run_drew(tmp_path):
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=MODEL, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b"), out)
    runs = train_whole_and_resumed(out, 2, tmp_path)
    whole, parts = (read_metrics(runs[name] / "metrics.jsonl") for name in ("whole", "parts"))
    assert [m["step"] for m in parts] == [0, 1, 2, 3]
    assert [m["loss"] for m in parts] == pytest.approx([m["loss"] for m in whole], rel=1e-6)


@pytest.mark.multiprocess
def test_verify_compares_a_pipeline_of_a_model_with_dropout_with_dropout_off(tmp_path):
    """A plan of two stages and two microbatches, or of two tensor-parallel ranks, draws where one
    process cannot: verify trains both with every dropout passing its input (train.py's
    --no-dropout), which leaves the rest to match; a plan of one stage, one microbatch and one rank
    is compared with dropout on."""
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=MODEL, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b",
                                        recompute="full"), out)
    result = run_cli("verify", str(out), "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "both trained with dropout off" in result.stdout and "match the original model" in result.stdout
    single = tmp_path / "single"
    compile_to_directory(CompileOptions(model=MODEL, pp=1, microbatches=1, micro_batch_size=2), single)
    result = verify(single, steps=2)
    assert not result.without_dropout and result.matches, result.failures[:3]
    split = tmp_path / "tp"  # one stage and one microbatch, but sequence-parallel slices draw each their own
    compile_to_directory(CompileOptions(model=MODEL, pp=1, tp=2, microbatches=1, micro_batch_size=2), split)
    result = verify(split, steps=2)
    assert result.without_dropout and result.matches, result.failures[:3]


@pytest.mark.multiprocess
def test_held_out_losses_are_computed_without_dropout(tmp_path):
    """The graph has its dropouts' training flag baked in: evaluating it as captured would drop
    units. At learning rate 0 the weights stay as made, so the pipeline's held-out losses (drawn
    per stage and microbatch if drawn at all) must equal one process's without dropout."""
    run = compile_and_train(tmp_path, MODEL, pp=2, microbatches=2, schedule="1f1b", lr=0.0,
                            train_args=("--eval-every", "1", "--eval-batches", "2"))
    reference = train_reference(run.out, steps=run.steps, lr=0.0, optimizer="sgd", eval_every=1, eval_batch_count=2)
    evaluated = [m["eval_loss"] for m in run.metrics if "eval_loss" in m]
    assert len(evaluated) == run.steps
    assert evaluated == pytest.approx([reference.eval_losses[s] for s in range(run.steps)], rel=1e-5)


def _draw_sharded(rank: int, port: int) -> None:
    with gloo_group(rank, port, 2):
        collectives.set_group(dist.group.WORLD)
        torch.manual_seed(7)  # the forward's seed: the same on both ranks
        kept = collectives.sharded_dropout(torch.ones(4096), 0.5) != 0
        after = torch.rand(4)  # the forward's stream goes on alike on both ranks
        masks, streams = [torch.zeros_like(kept) for _ in range(2)], [torch.zeros(4) for _ in range(2)]
        dist.all_gather(masks, kept)
        dist.all_gather(streams, after)
        assert not torch.equal(masks[0], masks[1]), "each rank's slice has a mask of its own"
        assert torch.equal(streams[0], streams[1])
        torch.manual_seed(7)
        assert torch.equal(collectives.sharded_dropout(torch.ones(4096), 0.5) != 0, kept), "a recompute draws it again"


@pytest.mark.multiprocess
def test_a_dropout_of_a_split_tensor_draws_a_mask_per_rank_and_the_forward_stream_goes_on_alike():
    assert fork_ranks(_draw_sharded, 2) == [0, 0]


def _tensor_parallel_losses(folder, *, model: Path = MODEL, **options) -> tuple[list[float], Path]:
    """Losses of 3 steps of a tp 2 plan of the model (`compile_and_train` reads whole stages' weights)."""
    out, metrics = folder / "out", folder / "metrics.jsonl"
    compile_to_directory(CompileOptions(model=model, pp=1, tp=2, micro_batch_size=2, optimizer="sgd", **options), out)
    run_ranks(out, 2, "--steps", "3", "--lr", "0.1", "--optimizer", "sgd", "--metrics", str(metrics))
    return [m["loss"] for m in read_metrics(metrics)], out


@pytest.mark.multiprocess
def test_sequence_parallel_dropout_is_emitted_per_rank_and_replayed_by_recompute(tmp_path):
    kept, out = _tensor_parallel_losses(tmp_path / "kept", microbatches=2)
    assert load_plan(out / "plan.json").sp
    assert "tp.sharded_dropout(" in (out / "stages" / "stage_0.py").read_text()
    rebuilt, _ = _tensor_parallel_losses(tmp_path / "rebuilt", microbatches=2, recompute="full")
    assert rebuilt == pytest.approx(kept, rel=1e-6)


def test_torch_dropout_of_a_split_tensor_is_emitted_per_rank(tmp_path):
    """``torch.dropout(x, p, train)``, which fx keeps as it is written, draws per rank as ``F.dropout`` does."""
    model = tmp_path / "torch_dropout_gpt.py"
    line = "return x + F.dropout(self.out(F.gelu(self.fc(self.ln_2(x)))), DROPOUT, self.training)"
    assert line in MODEL.read_text()
    model.write_text(MODEL.read_text().replace(line, line.replace("F.dropout", "torch.dropout").replace(
        "self.training", "train=self.training")))
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=1, tp=2, microbatches=2, micro_batch_size=2,
                                        device=str(FREE_LINKS)), out)  # every op that can split does
    source = (out / "stages" / "stage_0.py").read_text()
    assert load_plan(out / "plan.json").sp and "torch.dropout(" not in source, source
    assert source.count("= tp.sharded_dropout(") == 2 and "train=" not in source, source


@pytest.mark.multiprocess
def test_attention_with_dropout_splits_its_heads_each_rank_drawing_its_own(tmp_path):
    """Attention with dropout on the probabilities was kept whole under tensor parallelism (one
    seed would give every rank's heads the same masks); its heads now split, each rank drawing
    from a stream of its own, and a recompute draws it again."""
    model = tmp_path / "attention_dropout_gpt.py"
    model.write_text(MODEL.read_text().replace("ATTENTION_DROPOUT = 0.0", "ATTENTION_DROPOUT = 0.1"))
    split = {"model": model, "microbatches": 2, "device": str(FREE_LINKS)}  # every op that can split does
    kept, out = _tensor_parallel_losses(tmp_path / "kept", **split)
    assert "tp.sharded_attention(" in (out / "stages" / "stage_0.py").read_text()
    rebuilt, _ = _tensor_parallel_losses(tmp_path / "rebuilt", **split, recompute="full")
    assert rebuilt == pytest.approx(kept, rel=1e-6)


@pytest.mark.multiprocess
def test_an_exported_graph_s_dropouts_are_the_functions_the_runtime_turns_off(tmp_path):
    """torch.export writes aten ops, which pass beneath the runtime's NoDropout: the capture gives
    an exported graph's dropouts and attention as the torch functions (attention's dropout_p by
    name), so verify's dropout-off comparison holds for it too."""
    model = tmp_path / "attention_dropout_gpt.py"
    model.write_text(MODEL.read_text().replace("ATTENTION_DROPOUT = 0.0", "ATTENTION_DROPOUT = 0.1"))
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b",
                                        capture="export"), out)
    source = "".join(p.read_text() for p in (out / "stages").glob("stage_*.py"))
    assert "F.dropout(" in source and "dropout_p=0.1" in source and "aten.dropout" not in source
    assert "aten.scaled_dot_product_attention" not in source
    result = verify(out, steps=2)
    assert result.without_dropout and result.matches, result.failures[:3]


def test_no_dropout_reaches_positional_and_composite_dropouts():
    """What the capture leaves: attention's dropout_p by position, ``nn.MultiheadAttention``'s
    dropout inside one composite function, in-place dropouts, and a tensor-parallel rank's own."""
    torch.manual_seed(0)
    q, x = torch.randn(2, 2, 8, 4), torch.randn(3, 8)
    attention = torch.nn.MultiheadAttention(8, 2, dropout=0.9, batch_first=True)
    with NoDropout():
        assert torch.equal(F.scaled_dot_product_attention(q, q, q, None, 0.9, True),
                           F.scaled_dot_product_attention(q, q, q, is_causal=True))
        assert torch.equal(collectives.sharded_attention(q, q, q, dropout_p=0.9), F.scaled_dot_product_attention(q, q, q))
        assert torch.equal(attention(x[None], x[None], x[None])[0], attention(x[None], x[None], x[None])[0])
        assert torch.equal(torch.dropout_(x.clone(), 0.9, True), x)
        assert torch.equal(collectives.sharded_dropout(x, 0.9), x)


NO_DRAWS = """
import torch
from torch import nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).transpose(1, 3).unbind(2)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True).transpose(1, 2).flatten(2)


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Attention(), nn.Dropout(0.0), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 6, 8),), torch.randn(batch_size, 6, 4)


def loss_fn(output, target):
    return F.mse_loss(output, target)
"""


@pytest.mark.multiprocess
def test_a_dropout_of_zero_draws_nothing_and_is_compared_as_it_is(tmp_path):
    """An attention's ``dropout_p=0.0`` and an ``nn.Dropout(0.0)`` draw nothing: verify compares the
    programs as they are, where it turned every dropout off for them."""
    model = tmp_path / "no_draws.py"
    model.write_text(NO_DRAWS)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, measure=False), out)
    source = "".join(p.read_text() for p in (out / "stages").glob("*.py"))
    assert "dropout_p=0.0" in source and "F.dropout(" in source
    result = verify(out, steps=2)
    assert not result.without_dropout and result.matches, result.failures[:3]


@pytest.mark.multiprocess
def test_an_attention_dropout_given_by_place_draws(tmp_path):
    """``F.scaled_dot_product_attention(q, k, v, None, 0.2)`` (as nn.MultiheadAttention passes its
    own) draws: verify turns it off in both runs, where comparing draws made apart would fail."""
    model = tmp_path / "draws.py"
    model.write_text(NO_DRAWS.replace("dropout_p=0.0, is_causal=True", "None, 0.2, True"))
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, measure=False), out)
    assert "None, 0.2, True)" in (out / "stages" / "stage_0.py").read_text()
    result = verify(out, steps=2)
    assert result.without_dropout and result.matches, result.failures[:3]


LEAF_DROPOUT = '''
import torch
from torch import nn


class Block(nn.Module):  # kept whole (--leaf): its dropout is the model's code, not the stage file's
    def __init__(self):
        super().__init__()
        self.linear, self.drop = nn.Linear(16, 16), nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.relu(self.linear(x)))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
'''


@pytest.mark.multiprocess
def test_a_dropout_inside_a_leaf_module_is_turned_off_for_the_comparison(tmp_path):
    """A --leaf module's forward is the model's code, which the stage files call and do not show:
    verify cannot tell that it draws nothing, so it compares both runs with dropout off."""
    model = tmp_path / "leafy.py"
    model.write_text(LEAF_DROPOUT)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, leaf=("Block",),
                                        measure=False), out)  # fmt: skip
    assert "dropout(" not in "".join(p.read_text() for p in (out / "stages").glob("*.py")).lower(), "no call shows"
    result = verify(out, steps=2)
    assert result.without_dropout and result.matches, result.failures[:3]
