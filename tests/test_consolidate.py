"""``autopart consolidate`` builds the model from the user's model file, never from the checkpoint's.

A checkpoint folder holds a copy of ``model.py``; whoever hands over a checkpoint could put
anything in it. The checkpoint here is written in this process with DCP (no torchrun), from a
compile's initial weights, and its ``model.py`` creates a sentinel file when imported.
"""

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from autopart.tools import cli
from autopart.runtime.checkpoint_folders import RECORD
from tests.distributed import REPO, environment

GPT = REPO / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the checkpoint folder, the model file its plan names, the sentinel its model.py would create)."""
    folder = tmp_path_factory.mktemp("consolidate")
    model = shutil.copyfile(GPT, folder / "gpt.py")
    out = folder / "out"
    cli.main(["compile", str(model), "-o", str(out), "--pp", "2", "--microbatches", "2", "--global-batch-size", "4",
              "--device", "h100-sxm", "--time-limit", "5"])
    sentinel = folder / "SENTINEL"
    save_weights_as_checkpoint(out, folder / "ckpt", f"open({str(sentinel)!r}, 'w').close()\n" + GPT.read_text())
    return folder / "ckpt", model, sentinel


def save_weights_as_checkpoint(out: Path, root: Path, model_source: str | None = None) -> None:
    """A compile's initial weights (two stages, no TP) saved as the checkpoint of step 1 under ``root``."""
    step = root / "step_00000001"
    state = {f"model/stage_{k}/tp_0/{name}": value
             for k in (0, 1) for name, value in load_file(str(out / "weights" / f"stage_{k}.safetensors")).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
    shutil.copyfile(out / "plan.json", step / "plan.json")
    if model_source is not None:
        (step / "model.py").write_text(model_source)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step.iterdir() if p.is_file()}
    (step / RECORD).write_text(json.dumps({"step": 1, "optimizer": "adamw", "plan_sha256": "", "files": files}))


def consolidate(capsys, checkpoint: Path, output: Path, *extra: str) -> tuple[int, str]:
    try:
        cli.main(["consolidate", str(checkpoint), "-o", str(output), *extra])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


def test_without_model_the_plan_s_model_file_is_named_and_not_imported(checkpoint, tmp_path, capsys):
    """The checkpoint's plan.json names a model file: a checkpoint handed over could name any
    script here, with its true hash (and the record's), and consolidate imported it. Only a file
    given with --model is imported; the refusal names the plan's, to pass if it is the user's."""
    root, model, sentinel = checkpoint
    code, err = consolidate(capsys, root, tmp_path / "m.safetensors")
    assert code == 2 and re.fullmatch(
        rf"autopart: error: consolidate imports only a model file given with --model: the checkpoint's plan names "
        rf"'{re.escape(str(model))}', but a checkpoint is data and what it names is not run; pass --model "
        rf"{re.escape(str(model))} if that is the model file you compiled\n", err), err
    code, err = consolidate(capsys, root, tmp_path / "m.safetensors", "--model", str(model))
    assert code == 0, err
    from autopart.ir.model_file import load_model_file

    load_model_file(model).module.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
    script, marker = tmp_path / "other.py", tmp_path / "MARKER"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    forged = shutil.copytree(root, tmp_path / "forged")
    step = forged / "step_00000001"
    plan = json.loads((step / "plan.json").read_text())
    plan["provenance"].update(model_file=str(script), model_sha256=hashlib.sha256(script.read_bytes()).hexdigest())
    (step / "plan.json").write_text(json.dumps(plan))
    record = json.loads((step / RECORD).read_text())
    record["files"]["plan.json"] = hashlib.sha256((step / "plan.json").read_bytes()).hexdigest()
    (step / RECORD).write_text(json.dumps(record))
    code, err = consolidate(capsys, forged, tmp_path / "f.safetensors")
    assert not marker.exists(), "consolidate imported the file that the checkpoint's plan names"
    assert code == 2 and len(err.splitlines()) == 1 and f"plan names '{script}'" in err, err
    assert not (tmp_path / "f.safetensors").exists() and not sentinel.exists()


def test_model_given_with_model_is_used(checkpoint, tmp_path, capsys):
    root, model, sentinel = checkpoint
    model.rename(model.with_suffix(".moved"))  # the plan's path is gone: --model says where it is
    try:
        code, err = consolidate(capsys, root, tmp_path / "m.safetensors", "--model", str(GPT))
        assert code == 0, err
        assert set(load_file(str(tmp_path / "m.safetensors"))) >= {"wte.weight"}
        code, err = consolidate(capsys, root, tmp_path / "n.safetensors", "--model", str(model))
        assert code == 2 and f"model file '{model}' does not exist; pass the model file that was compiled" in err
    finally:
        model.with_suffix(".moved").rename(model)
    assert not sentinel.exists()
    assert torch.equal(load_file(str(tmp_path / "m.safetensors"))["wte.weight"],
                       load_file(str(root.parent / "out" / "weights" / "stage_0.safetensors"))["wte.weight"])


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem")
def test_an_unreadable_model_file_is_refused_in_one_line(checkpoint, tmp_path, capsys):
    """A model file given with --model that is there but cannot be read: a link
    to /proc/self/mem, whose first page no process reads (root reads a file without permission)."""
    root, model, sentinel = checkpoint
    unread = tmp_path / "unread.py"
    unread.symlink_to("/proc/self/mem")
    code, err = consolidate(capsys, root, tmp_path / "m.safetensors", "--model", str(unread))
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"model file '{unread}' cannot be read (Input/output error)" in err
    assert not (tmp_path / "m.safetensors").exists() and not sentinel.exists()


def test_a_parameter_no_stage_reads_is_written_as_the_model_builds_it(tmp_path, capsys):
    """The compile leaves out a parameter the forward never reads, so no checkpoint holds it; no
    gradient reaches it and no optimizer steps it, so its value is the one build_model() gives."""
    from autopart.ir.model_file import load_model_file

    model = tmp_path / "gpt_unused.py"
    model.write_text(GPT.read_text().replace(
        "        self.ln_f = nn.LayerNorm(config.n_embd)\n",
        "        self.ln_f = nn.LayerNorm(config.n_embd)\n        self.unused = nn.Linear(4, 4)  # read by nothing\n", 1))
    out = tmp_path / "out"
    cli.main(["compile", str(model), "-o", str(out), "--pp", "2", "--microbatches", "2", "--no-measure"])
    assert "unused.weight" not in (out / "stages" / "stage_1.py").read_text()
    save_weights_as_checkpoint(out, tmp_path / "ckpt")
    capsys.readouterr()
    code, err = consolidate(capsys, tmp_path / "ckpt", tmp_path / "model.safetensors", "--model", str(model))
    assert code == 0, err
    assert "no stage reads unused.weight, unused.bias" in err
    written = load_file(str(tmp_path / "model.safetensors"))
    built = load_model_file(model).module.state_dict()
    assert written.keys() == built.keys()
    assert torch.equal(written["unused.weight"], built["unused.weight"])


@pytest.mark.parametrize("edit, message", [
    (("n_embd: int = 64", "n_embd: int = 128"), r"gpt_other\.py's model holds '\S+' at \([\d, ]+\), the checkpoint at \([\d, ]+\); give the model file"),
    (("n_layer: int = 4", "n_layer: int = 2"), r"gpt_other\.py's model has no 'h\.2\.\S+', which the checkpoint holds"),
])  # fmt: skip
def test_a_model_given_with_model_that_is_not_the_checkpoint_s_is_refused(checkpoint, tmp_path, capsys, edit, message):
    """Written anyway, the file would not load into that model, or would leave trained layers out."""
    root, _, _ = checkpoint
    other = tmp_path / "gpt_other.py"
    assert edit[0] in GPT.read_text()
    other.write_text(GPT.read_text().replace(*edit))
    code, err = consolidate(capsys, root, tmp_path / "m.safetensors", "--model", str(other))
    assert code == 2 and len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "m.safetensors").exists()


def test_a_file_of_the_user_s_at_o_is_kept_and_consolidate_s_own_is_replaced(checkpoint, tmp_path, capsys):
    """-o over the user's own file (their model source, weights of their own) is refused before any
    work: it was replaced without a word. A file that consolidate wrote is replaced, as a rerun does."""
    from safetensors.torch import save_file

    root, model, _ = checkpoint
    theirs = {"mine.py": b"print('four years of work')\n"}
    save_file({"w": torch.ones(2)}, str(tmp_path / "theirs.safetensors"))
    theirs["theirs.safetensors"] = (tmp_path / "theirs.safetensors").read_bytes()
    (tmp_path / "mine.py").write_bytes(theirs["mine.py"])
    for name, before in theirs.items():
        code, err = consolidate(capsys, root, tmp_path / name)
        assert code == 2 and re.fullmatch(rf"autopart: error: -o .*{re.escape(name)} exists and autopart consolidate did "
                                          r"not write it; give a new path, or move the file away first\n", err), err
        assert (tmp_path / name).read_bytes() == before
    for _ in range(2):
        code, err = consolidate(capsys, root, tmp_path / "m.safetensors", "--model", str(model))
        assert code == 0, err



class _Touch:
    """Unpickled, it creates ``path``: the harmless payload of a crafted checkpoint file."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_an_entry_that_dcp_would_unpickle_is_refused_in_one_line_and_runs_nothing(checkpoint, tmp_path, capsys):
    """A checkpoint whose metadata calls a tensor's entry ``BytesStorageMetadata`` (keeping the
    tensor's size, so that it still looks like one) and points it at a pickle beside it: DCP's load
    planner reads such an entry with ``torch.load(weights_only=False)``. The record lists the files
    with their true hashes, as whoever hands over a whole folder would write it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    root, _, sentinel = checkpoint
    crafted = shutil.copytree(root, tmp_path / "ckpt")
    step = crafted / "step_00000001"
    metadata = pickle.loads((step / ".metadata").read_bytes())
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model/stage_0/"))
    entry = BytesStorageMetadata()
    entry.size, entry.properties = metadata.state_dict_metadata[key].size, metadata.state_dict_metadata[key].properties
    metadata.state_dict_metadata[key] = entry
    marker = tmp_path / "MARKER"
    payload = pickle.dumps(_Touch(marker))
    (step / "evil.bin").write_bytes(payload)
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("evil.bin", 0, len(payload))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step.iterdir() if p.name != RECORD}
    (step / RECORD).write_text(json.dumps({**json.loads((step / RECORD).read_text()), "files": files}))
    code, err = consolidate(capsys, crafted, tmp_path / "m.safetensors")
    assert not marker.exists(), "the crafted checkpoint ran its payload"
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"autopart: error: checkpoint metadata names torch\.distributed\.checkpoint\.metadata\."
                        r"BytesStorageMetadata, which no checkpoint holds; it is damaged or autopart did not save it, "
                        r"so it is not read \(use a checkpoint that autopart saved\)\n", err), err
    assert not (tmp_path / "m.safetensors").exists() and not sentinel.exists()


BUFFERED = '''
import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)  # running statistics, and a counter that the capture leaves out

    def forward(self, x):
        return x + torch.tanh(self.norm(self.linear(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8), persistent=False)  # as a Llama's rotary tables

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * self.scale
        return x.pow(2).mean()


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), None
'''


@pytest.fixture
def buffered(tmp_path) -> tuple[Path, Path]:
    """(a compile at pp 2 of a model with a non-persistent buffer and BatchNorms, its checkpoint folder)."""
    model = tmp_path / "buffered.py"
    model.write_text(BUFFERED)
    out = tmp_path / "out"
    cli.main(["compile", str(model), "-o", str(out), "--pp", "2", "--microbatches", "2", "--no-measure"])
    assert "scale" in (out / "stages" / "stage_1.py").read_text(), "each stage holds the buffer it reads"
    save_weights_as_checkpoint(out, tmp_path / "ckpt")
    return out, tmp_path / "ckpt"


def test_the_file_holds_the_state_dict_of_a_model_with_buffers_outside_it(buffered, tmp_path, capsys):
    """A non-persistent buffer, which the stages hold, is not written (the model's load_state_dict
    refuses it: 'has no scale' stopped consolidation); BatchNorm's num_batches_tracked, which its
    stage counts up (an in-place op whose value nothing reads, run for its effect), is written as
    the stage holds it."""
    from autopart.ir.model_file import load_model_file

    out, root = buffered
    capsys.readouterr()
    code, err = consolidate(capsys, root, tmp_path / "model.safetensors", "--model", str(out / "model.py"))
    assert code == 0, err
    written = load_file(str(tmp_path / "model.safetensors"))
    module = load_model_file(out / "model.py").module
    assert written.keys() == module.state_dict().keys()
    module.load_state_dict(written, strict=True)
    trained = load_file(str(out / "weights" / "stage_0.safetensors"))
    assert torch.equal(written["layers.0.norm.running_var"], trained["layers.0.norm.running_var"])
    assert torch.equal(written["layers.0.norm.num_batches_tracked"], trained["layers.0.norm.num_batches_tracked"])


def test_weights_saved_from_the_state_dict_load_into_every_stage(buffered, tmp_path):
    """train.py --weights takes model.state_dict(), which holds no non-persistent buffer: the
    stages take theirs from weights/ ('lacks 1 tensor(s) of stage 0, first 'scale'' before)."""
    from safetensors.torch import save_file

    from autopart.ir.model_file import load_model_file
    from autopart.runtime.stage import check_checkpoint, load_stage, state_names

    out, _ = buffered
    module = load_model_file(out / "model.py").module
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(1.0)  # weights other than the compile's
    weights = tmp_path / "state.safetensors"
    save_file(module.state_dict(), str(weights))
    for index in (0, 1):
        check_checkpoint(weights, state_names(out, index), index)
        stage = load_stage(out, index, torch.device("cpu"), weights=weights)
        held = dict(stage.named_parameters()) | dict(stage.named_buffers())
        assert "scale" in held
        assert torch.equal(held["scale"], module.scale)
        for name, value in held.items():
            torch.testing.assert_close(value, module.get_parameter(name) if name.endswith(("weight", "bias"))
                                       else module.get_buffer(name), msg=name)


@pytest.mark.multiprocess
def test_weights_load_into_a_model_that_imports_a_file_beside_it(tmp_path):
    """The model's state-dict names are read from the model file compiled, whose imports of files
    beside it work, not from OUT's copy (ModuleNotFoundError: 'layers' on every rank)."""
    from safetensors.torch import save_file

    from autopart.ir.model_file import load_model_file
    from tests.distributed import run_ranks
    from tests.tiny_models import beside_model

    model = beside_model(tmp_path)
    out = tmp_path / "out"
    cli.main(["compile", str(model), "-o", str(out), "--pp", "2", "--microbatches", "2", "--no-measure"])
    weights = tmp_path / "state.safetensors"
    save_file(load_model_file(model).module.state_dict(), str(weights))
    run_ranks(out, 2, "--steps", "1", "--weights", str(weights))


COUNT_OPENS = """
import os
import sys

from autopart.ir.errors import AutopartError
from autopart.tools.consolidate import consolidated_state

root, watched, opened = sys.argv[1], os.path.realpath(sys.argv[2]), []


def count(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and os.path.realpath(args[0]) == watched:
        opened.append(args[0])


sys.addaudithook(count)
try:
    consolidated_state(root)
except AutopartError as exc:
    print(exc)
print(len(opened))
"""


def test_every_damaged_checkpoint_is_hashed_once_and_the_refusal_says_how_many(tmp_path):
    """The newest checkpoint's files were hashed twice, once to pass it over and again for the
    refusal's reason: on a large checkpoint, minutes. A process of its own counts the opens of
    the newest's one file (an audit hook, which this process would keep for good)."""
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        folder = root / f"step_0000000{step}"
        folder.mkdir(parents=True)
        (folder / "shard.bin").write_bytes(bytes(1 << 16))
        (folder / RECORD).write_text(json.dumps({"step": step, "files": {"shard.bin": "0" * 64}}))
    result = subprocess.run([sys.executable, "-c", COUNT_OPENS, str(root), str(root / "step_00000003" / "shard.bin")],
                            capture_output=True, text=True, timeout=120, env=environment())
    assert result.returncode == 0, result.stderr[-2000:]
    refusal, opens = result.stdout.strip().splitlines()
    assert re.fullmatch(r"every checkpoint in '.*ckpt' is damaged \(3 checked; the newest, step_00000003: shard\.bin "
                        r"does not match its sha256\); restore the folder from a copy", refusal), refusal
    assert opens == "1"
