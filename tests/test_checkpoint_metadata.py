"""A crafted checkpoint runs nothing: every way out of the metadata unpickler is refused in one line.

Each ``.metadata`` here would run ``touch SENTINEL`` (or reach a function that could) if it were
unpickled as DCP itself unpickles it; ``autopart consolidate`` must stop with one line, exit 2,
and leave no sentinel behind. The checkpoint's ``autopart.json`` lists the crafted file with its
true hash, as an attacker who hands over a whole folder would write it.
"""

import hashlib
import json
import os
import pickle
import re
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from autopart.tools import cli
from autopart.ir.errors import CheckpointError
from autopart.runtime.checkpoint import read_metadata_file
from autopart.runtime.checkpoint_folders import RECORD, remove_saved

META = "torch.distributed.checkpoint.metadata"


def _text(value: str) -> bytes:
    data = value.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) if len(data) < 256 else pickle.BINUNICODE + struct.pack("<I", len(data))


def _string(value: str) -> bytes:
    return _text(value) + value.encode()


def stack_global(module: str, name: str) -> bytes:
    """Protocol 4's STACK_GLOBAL: the name may be dotted, resolved attribute by attribute."""
    return _string(module) + _string(name) + pickle.STACK_GLOBAL


def call(callable_: bytes, *args: bytes) -> bytes:
    return callable_ + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def program(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


class _Escape(Metadata):
    """An allowed class whose ``__reduce__`` names another callable: pickle writes that callable."""

    command = ""

    def __reduce__(self):
        return (os.system, (self.command,))


def crafted(case: str, sentinel: Path) -> bytes:
    command = f"touch {sentinel}"
    if case == "dotted name through an allowed module":  # DCP's metadata module imports os
        return program(call(stack_global(META, "os.system"), _string(command)))
    if case == "dotted name through an allowed class":
        return program(call(stack_global("pathlib", "PosixPath.__init__.__globals__"), _string(command)))
    if case == "reduce of an allowed class":
        _Escape.command = command
        return pickle.dumps(_Escape(state_dict_metadata={}), protocol=4)
    if case == "builtins.getattr":
        getattr_ = stack_global("builtins", "getattr")
        system = call(getattr_, call(stack_global(META, "os")), _string("system"))
        return program(call(system, _string(command)))
    if case == "os.system":
        return program(call(stack_global("os", "system"), _string(command)))
    if case == "a module an allowed module imported":
        return program(stack_global(META, "os"))
    if case == "not a pickle":
        return b"\x80\x04garbage"
    assert case == "not metadata"
    return pickle.dumps(3, protocol=4)


CASES = {
    "dotted name through an allowed module": "names torch.distributed.checkpoint.metadata.os.system, which no checkpoint holds",
    "dotted name through an allowed class": "names pathlib.PosixPath.__init__.__globals__",
    "reduce of an allowed class": "system, which no checkpoint holds",
    "builtins.getattr": "names builtins.getattr, which no checkpoint holds",
    "os.system": "names os.system, which no checkpoint holds",
    "a module an allowed module imported": "names torch.distributed.checkpoint.metadata.os, which no checkpoint holds",
    "not a pickle": "is unreadable",
    "not metadata": "holds a int, not DCP's Metadata",
}


def crafted_checkpoint(folder: Path, metadata: bytes) -> Path:
    folder.mkdir()
    (folder / ".metadata").write_bytes(metadata)
    files = {".metadata": hashlib.sha256(metadata).hexdigest()}
    (folder / RECORD).write_text(json.dumps({"step": 1, "optimizer": "sgd", "plan_sha256": "0", "files": files}))
    return folder


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_metadata_is_refused_in_one_line_and_runs_nothing(tmp_path, capsys, case):
    sentinel = tmp_path / "SENTINEL"
    checkpoint = crafted_checkpoint(tmp_path / "ckpt", crafted(case, sentinel))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["consolidate", str(checkpoint), "-o", str(tmp_path / "model.safetensors")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopart: error: checkpoint metadata"), err
    assert CASES[case] in lines[0], lines[0]
    assert not sentinel.exists(), "the crafted metadata ran a command"
    assert not (tmp_path / "model.safetensors").exists()
    with pytest.raises(CheckpointError):
        read_metadata_file(checkpoint / ".metadata")
    assert not sentinel.exists()


def test_a_step_saved_again_removes_only_what_its_record_lists(tmp_path):
    """Saving a step that exists replaces it file by file: a file that the record does not list
    (the user's) stops the replacement before anything is removed."""
    step = crafted_checkpoint(tmp_path / "step_00000001", b"metadata")
    (step / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="holds notes.txt, which autopart did not save there"):
        remove_saved(step)
    assert sorted(p.name for p in step.iterdir()) == [".metadata", RECORD, "notes.txt"]
    (step / "notes.txt").unlink()
    remove_saved(step)
    assert not step.exists()
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "thesis.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="holds no readable autopart.json"):
        remove_saved(tmp_path / "step_00000002")
    assert (tmp_path / "step_00000002" / "thesis.txt").exists()


def _entry_of_another_kind(metadata) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata.state_dict_metadata["w"] = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([3]))


def _a_part_to_decode(metadata) -> None:
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd/1"]


def _a_part_elsewhere(metadata) -> None:
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"


@pytest.mark.parametrize(("edit", "held"), [(_entry_of_another_kind, "'w' as a ChunkStorageMetadata"),
                                            (_a_part_to_decode, r"a file part of another kind \(_StorageInfo\)"),
                                            (_a_part_elsewhere, r"a file part at '\.\./elsewhere\.distcp', outside "
                                                                r"the checkpoint's files")])
def test_metadata_of_what_autopart_never_saves_is_refused_in_one_line(tmp_path, capsys, edit, held):
    """Only plain tensors of the checkpoint's own files are read: an entry of another kind would
    reach DCP's reading of non-tensors, a file part to decode its stream extensions, a part
    elsewhere a file outside the folder (which its record's hashes do not cover)."""
    step = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
    metadata = pickle.loads((step / ".metadata").read_bytes())
    edit(metadata)
    shutil.rmtree(step)
    crafted_checkpoint(step, pickle.dumps(metadata))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["consolidate", str(step), "-o", str(tmp_path / "model.safetensors")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert re.fullmatch(rf"autopart: error: checkpoint metadata .*ckpt/\.metadata holds {held}, where autopart saves "
                        r"tensors alone; it is damaged or autopart did not save it, so it is not read \(use a "
                        r"checkpoint that autopart saved\)\n", err), err
