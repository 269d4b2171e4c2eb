"""The model file's own functions and classes that its captured code calls (an ``fx.wrap``
function, the dataclass or NamedTuple its forward returns) reach the stage programs from
OUT/model.py: the compile imports the model under a name of its own, which the stages imported
and no rank could (every rank died, and the compile, measuring its plan, only warned)."""

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.tools.verify import verify
from tests.tiny_models import token_model

MODEL = token_model("""
import dataclasses
from typing import NamedTuple

import torch
from torch import nn
import torch.nn.functional as F

D, V, T = 32, 64, 8


@torch.fx.wrap
def scaled_gelu(x):
    return F.gelu(x) * 1.5


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor


class Tupled(NamedTuple):
    logits: torch.Tensor
    aux: torch.Tensor


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(scaled_gelu(self.fc1(self.ln(x))))

""", output="OUTPUT(logits=self.head(x), aux=x.pow(2).mean())") + """

def loss_fn(out, target):
    return F.cross_entropy(out.logits.reshape(-1, V), target.reshape(-1)) + 0.1 * out.aux
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("output", ["Out", "Tupled"])
def test_the_model_file_s_own_functions_and_classes_reach_the_stages(tmp_path, output):
    model = tmp_path / "own.py"
    model.write_text(MODEL.replace("OUTPUT", output))
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, capture="fx",
                                        measure=False), out)  # fmt: skip
    source = "".join(p.read_text() for p in (out / "stages").glob("*.py"))
    assert "scaled_gelu = model_attribute(MODEL_FILE, 'scaled_gelu')" in source and "_autopart_model_" not in source
    result = verify(out, steps=2)
    assert result.matches, result.failures[:3]
