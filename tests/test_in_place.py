"""An in-place op whose result nothing reads (``att.masked_fill_(mask, -inf)``, ``x.add_(bias)``)
has its effect on its input: the stage programs run it, where fx's dead-code pass, which takes
such a call for pure, dropped it (the causal mask lost, the bias never trained) and the run
trained another model than the one compiled."""

import pytest

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.tools.verify import verify
from tests.tiny_models import token_model

MODEL = token_model("""
import math, torch
from torch import nn
import torch.nn.functional as F

D, V, T, H = 32, 64, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.bias = nn.Parameter(torch.full((D,), 0.5))
        self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), 1))

    def forward(self, x):
        h = self.ln(x)
        h.add_(self.bias)  # in place, its result unread
        qkv = self.qkv(h)
        q, k, v = (qkv[..., i * D:(i + 1) * D].reshape(-1, T, H, D // H).transpose(1, 2) for i in range(3))
        att = q @ k.transpose(-2, -1) / math.sqrt(D // H)
        att.masked_fill_(self.mask, float("-inf"))  # the causal mask, in place
        y = F.softmax(att, dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(-1, T, D))

""") + """

def loss_fn(out, target):
    return F.cross_entropy(out.reshape(-1, V), target.reshape(-1))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [dict(pp=2, microbatches=2), dict(tp=2, microbatches=1, device="h100-sxm")])
def test_in_place_ops_whose_result_is_unread_are_run(tmp_path, layout):
    model = tmp_path / "in_place.py"
    model.write_text(MODEL)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, micro_batch_size=2, measure=False, capture="fx", **layout), out)
    source = "".join(p.read_text() for p in (out / "stages").glob("*.py"))
    assert ".masked_fill_(" in source and ".add_(" in source  # once per layer, or once in a layer's shared method
    result = verify(out, steps=2)
    assert result.matches, result.failures[:3]


BUCKETS = token_model("""
import torch
from torch import nn
import torch.nn.functional as F

D, V, T = 16, 64, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.table, self.proj = nn.Embedding(T, D), nn.Linear(D, D)

    def forward(self, x):
        position = torch.arange(T, device=x.device)
        buckets = torch.zeros_like(position)
        buckets += (position >= T // 2).long() * (T // 2)  # in place, as T5's relative-position buckets
        buckets += position % (T // 2)  # 0 .. T-1
        return x + self.proj(torch.tanh(x + self.table(buckets)))

""") + """

def loss_fn(out, target):
    return F.cross_entropy(out.reshape(-1, V), target.reshape(-1))
"""


def test_measuring_an_in_place_op_leaves_the_values_later_ops_read(tmp_path):
    """The compile times each op on the values of a run of the model: an in-place op timed on them
    wrote them again, and the embedding after T5's ``buckets += ...`` (``add_`` under torch.export;
    fx traces ``+=`` on a proxy as ``+``) read an index past its table: an IndexError's traceback,
    where the model trains."""
    model = tmp_path / "buckets.py"
    model.write_text(BUCKETS)
    plan = autopart.compile(model, pp=2, microbatches=2, micro_batch_size=2, measure=False, capture="export")
    assert plan.provenance.capture == "export"


WRITTEN_LATE = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        written = torch.zeros_like(x)  # made from the batch alone
        written.add_(self.first(x))  # then written with a trained value
        late = written * 2  # read after the write, on the last stage
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h) + late


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 8)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
"""


@pytest.mark.multiprocess
def test_a_value_made_from_the_batch_and_written_in_place_is_sent_not_made_again(tmp_path):
    """A value made from the batch alone was made again by each stage that read it, without the
    write that came after: the last stage read zeros, ``first`` never trained and the head
    trained on another input. (torch.export has the product read the write's result, which is
    no value of the batch alone; torch.fx has it read the value written.)"""
    from tests.distributed import assert_same_training, compile_and_train

    path = tmp_path / "written_late.py"
    path.write_text(WRITTEN_LATE)
    run = compile_and_train(tmp_path, path, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", steps=3,
                            measure=False, capture="fx", stage_layers="3,3")  # a cut that the CPU's speed moves not
    assert [name for name, _ in run.plan.stages[1].inputs] == ["mul", "linear_3"]  # the product of the written value
    assert_same_training(run, optimizer="sgd", lr=0.1)
