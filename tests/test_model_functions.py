"""The model file's own functions and classes that its captured code calls (an ``fx.wrap``
function, the dataclass or NamedTuple its forward returns) reach the stage programs from
OUT/model.py: the compile imports the model under a name of its own, which the stages imported
and no rank could (every rank died, and the compile, measuring its plan, only warned)."""

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ModelFileError
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


LAYERS = """
import torch
from torch import nn


@torch.fx.wrap
def halved(x):
    return x * 0.5


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + halved(torch.relu(self.fc(x)))
"""

SPLIT_MODEL = """
import torch
from torch import nn
import torch.nn.functional as F

from IMPORTED import Block
from parts.head import Head


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(16) for _ in range(4)])
        self.head = Head()

    def forward(self, x):
        return self.head(self.blocks(x))


def build_model():
    return Model()


def example_batch(batch_size: int):
    return (torch.randn(batch_size, 16),), torch.randint(0, 4, (batch_size,))


def loss_fn(out, target):
    return F.cross_entropy(out, target)


def batches(batch_size, seed):
    from source import draw  # imported when training draws its data, never by the compile

    return draw(batch_size, seed)
"""

SOURCE = """
import torch


def draw(batch_size, seed):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield (torch.randn(batch_size, 16, generator=generator),), torch.randint(0, 4, (batch_size,), generator=generator)
"""


def _split_model(folder, imported: str = "layers"):
    """A model file that imports its layers from a file and a package beside it."""
    (folder / "parts").mkdir(parents=True)
    (folder / f"{imported}.py").write_text(LAYERS)
    (folder / "parts" / "__init__.py").write_text("")
    (folder / "parts" / "head.py").write_text("from torch import nn\n\n\nclass Head(nn.Linear):\n"
                                              "    def __init__(self):\n        super().__init__(16, 4)\n")
    (folder / "source.py").write_text(SOURCE)
    (folder / "split.py").write_text(SPLIT_MODEL.replace("IMPORTED", imported))
    return folder / "split.py"


@pytest.mark.multiprocess
def test_the_modules_a_model_file_imports_from_beside_it_travel_with_the_output(tmp_path):
    """``from layers import Block`` (with an fx.wrap function the stages call) and a package
    beside the model file: the output directory carries them, and trains where their folder is
    not (as on a cluster the directory was copied to). Every rank died of a ModuleNotFoundError."""
    import importlib.util
    import sys

    model = _split_model(tmp_path / "src")
    (tmp_path / "src" / "notes.py").write_text("")  # beside it, imported by the process (a notebook), not by the model
    notes = importlib.util.spec_from_file_location("notes", tmp_path / "src" / "notes.py")
    sys.modules["notes"] = importlib.util.module_from_spec(notes)
    out = tmp_path / "out"
    try:
        compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, capture="fx",
                                            measure=False), out)  # fmt: skip
    finally:
        sys.modules.pop("notes", None)
    assert (out / "layers.py").read_text() == LAYERS and (out / "parts" / "head.py").is_file()
    assert (out / "source.py").is_file() and not (out / "notes.py").exists()
    assert "from layers import halved" in "".join(p.read_text() for p in (out / "stages").glob("*.py"))
    (tmp_path / "src").rename(tmp_path / "gone")
    result = verify(out, steps=2)
    assert result.matches, result.failures[:3]


def test_a_module_beside_the_model_named_as_an_output_file_is_refused(tmp_path):
    model = _split_model(tmp_path / "src", imported="train")
    with pytest.raises(ModelFileError, match=r"^split.py imports train.py from beside it, a name the output directory "
                                             "keeps for its own files; rename that module$"):
        compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, measure=False),
                             tmp_path / "out")
    assert not (tmp_path / "out").exists()
