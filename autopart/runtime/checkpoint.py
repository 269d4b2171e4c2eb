"""Checkpoints: save, find the latest good one, resume, and consolidate into one state dict.

A checkpoint is a torch.distributed.checkpoint (DCP) directory ``DIR/step_<n>`` holding only
tensors, under keys that say whose they are:

    model/stage_<k>/tp_<r>/<name>               a stage's parameters and buffers (original names;
                                                under bf16 ZeRO-1 each master from the replica that holds it)
    optim/[dp_<d>/]stage_<k>/tp_<r>/<name>/<s>  optimizer state (per data-parallel rank with ZeRO-1)
    rng/rank_<i>/<generator>                    random number generator states
    progress/step, progress/seed                where the data stream stands

Replicas hold equal keys, which DCP writes once. Beside them: ``plan.json`` and ``model.py`` of
the compile, and ``autopart.json`` with the step, the optimizer, the training recipe's flags and
the sha256 of every file. Ranks write into ``DIR/.step_<n>.partial`` and rank 0 renames it into
place once every rank has finished, so a crash during a save leaves the previous checkpoint the
latest good one (`autopart.runtime.checkpoint_folders`: the folders, what is whole, what may go).
Nothing is unpickled on the way back beyond plain data: tensors are read with ``weights_only=True``
and DCP's metadata file through an unpickler that resolves only an exact list of DCP's metadata
classes, so a crafted ``.metadata`` is refused with one line before it can call anything. Nor may
the metadata name an entry that is not a tensor: DCP reads such an entry (``BytesStorageMetadata``)
with ``torch.load(weights_only=False)``, which unpickles a file of the checkpoint, and autopart
never saves one.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import random
import shutil
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from autopart.ir.errors import CheckpointError, ConfigError
from autopart.runtime.checkpoint_folders import (candidates, damaged, problem, put_in_place, read_record,
                                                 staging_folder, step_folder, step_of, write_digests, write_record)
from autopart.runtime.fully_sharded import is_sharded
from autopart.runtime.launch import plan_digest
from autopart.runtime.process_exit import say
from autopart.runtime.recipe import Recipe
from autopart.runtime.sharded_masters import ShardedMasters, holds_master

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "SafeReader",
    "training_state",
    "save_checkpoint",
    "restore_checkpoint",
    "read_metadata_file",
    "load_tensors",
    "restarted",
    "CheckpointContext",
]


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset({
    *((_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"), ("torch", "Size"), ("torch", "device"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
})  # fmt: skip
"""Every global that DCP's metadata pickle of tensors names, as exact (module, name) pairs: each is a
class whose construction only stores its arguments, a dtype, or a lookup of a layout by name. Not
``BytesStorageMetadata``: DCP unpickles the data of such an entry (`_check_entries`). A whole
module is never allowed (a module's namespace holds what it imported: ``os`` among them), nor a
dotted name (protocol 4 resolves ``a.b.c`` attribute by attribute, out of any allowed object)."""


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; this reads the globals of ``_ALLOWED`` and nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise CheckpointError(
                f"checkpoint metadata names {module}.{name}, which no checkpoint holds; it is damaged or autopart did "
                "not save it, so it is not read (use a checkpoint that autopart saved)"
            )
        return super().find_class(module, name)


def read_metadata_file(path: Path) -> Metadata:
    """DCP's ``Metadata`` from ``path``, or a ``CheckpointError`` that runs nothing of the file."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or garbled pickle fails in many ways, each a damaged file
        raise CheckpointError(f"checkpoint metadata {path} is unreadable ({type(exc).__name__}); "
                              "use an earlier step_* directory or save the checkpoint again") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint metadata {path} holds a {type(metadata).__name__}, not DCP's Metadata; "
                              "use a checkpoint that autopart saved")
    _check_entries(metadata, path)
    return metadata


def _check_entries(metadata: Metadata, path: Path) -> None:
    """Refuse metadata that would make DCP read anything but a tensor of the checkpoint's own files:
    an entry of another kind (``BytesStorageMetadata``, which DCP's load planner unpickles with
    ``weights_only=False``, even where the state dict asks for a tensor), a file part to be decoded
    by an extension, or one in a file elsewhere (`_in_folder`). autopart saves tensors alone,
    plainly, so such metadata is damaged or another program's."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        odd = "an index of another kind"
    else:
        odd = next((f"{key!r} as a {type(entry).__name__}" for key, entry in entries.items()
                    if type(entry) is not TensorStorageMetadata), None)
        odd = odd or next((f"a file part of another kind ({type(info).__name__})" for info in storage.values()
                           if type(info) is not _StorageInfo or getattr(info, "transform_descriptors", None)), None)
        odd = odd or next((f"a file part at {getattr(info, 'relative_path', None)!r}, outside the checkpoint's files"
                           for info in storage.values() if not _in_folder(info)), None)
    if odd is not None:
        raise CheckpointError(f"checkpoint metadata {path} holds {odd}, where autopart saves tensors alone; it is "
                              "damaged or autopart did not save it, so it is not read (use a checkpoint that autopart "
                              "saved)")


def _in_folder(info) -> bool:
    """Whether a part of DCP's metadata lies in a file of the checkpoint folder itself, by a bare
    name (DCP writes no other): a path elsewhere would read a file outside the checkpoint."""
    name, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
    return (type(name) is str and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name
            and type(offset) is int and type(length) is int and offset >= 0 and length >= 0)


def _dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is first saved or read: importing
    it (DTensor and the symbolic-shape machinery with it) costs every rank a noticeable share of its start."""
    import torch.distributed.checkpoint as dcp

    return dcp


@functools.cache
def _safe_reader() -> type:
    class SafeReader(_dcp().FileSystemReader):
        """``FileSystemReader`` whose metadata is read without running arbitrary pickled code."""

        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
            metadata = read_metadata_file(path)
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            if metadata.planner_data is None:
                metadata.planner_data = {}
            return metadata

    return SafeReader


def __getattr__(name: str):
    if name == "SafeReader":  # ``from autopart.runtime.checkpoint import SafeReader`` imports DCP then
        return _safe_reader()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here


def _saved_optimizer_state(shapes: dict) -> dict[tuple[int, int, str], dict[int | None, dict[str, str]]]:
    """The checkpoint's optimizer state keys (``_optimizer_prefix`` + parameter + state name) by
    (stage, tensor-parallel rank, parameter), then by the data-parallel replica that saved them
    (None where every replica saves the whole state), then by state name (``exp_avg``)."""
    found: dict = {}
    for key in shapes:
        parts = key.split("/")
        if parts[0] != "optim" or len(parts) not in (5, 6):
            continue
        replica = int(parts[1].removeprefix("dp_")) if len(parts) == 6 else None
        stage, tp, name, state_name = parts[-4:]
        where = (int(stage.removeprefix("stage_")), int(tp.removeprefix("tp_")), name)
        found.setdefault(where, {}).setdefault(replica, {})[state_name] = key
    return found


def _optimizer_prefix(stage: int, tp_rank: int, dp_rank: int, zero: int) -> str:
    """ZeRO-1's optimizer keeps each replica's part as plain tensors, so they are saved per
    replica; under FSDP (2, 3) the state is sharded tensors that the checkpoint stores whole."""
    return f"optim/{f'dp_{dp_rank}/' if zero == 1 else ''}stage_{stage}/tp_{tp_rank}/"


def training_state(
    stages: dict[int, nn.Module], optimizer: torch.optim.Optimizer, *, rank: int, dp_rank: int, tp_rank: int,
    zero: int, step: int, seed: int,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """This rank's share of the checkpoint: tensors that alias the live model and optimizer state."""
    state: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for s, module in stages.items():
        elsewhere = {n for n, p in module.named_parameters(remove_duplicate=False) if not holds_master(p)}
        for name, value in module.state_dict().items():
            if name not in elsewhere:  # a master that another replica holds (bf16 ZeRO-1) is saved by it
                state[f"model/stage_{s}/tp_{tp_rank}/{name}"] = value
        for name, parameter in module.named_parameters():
            names[id(parameter)] = _optimizer_prefix(s, tp_rank, dp_rank, zero) + name
    for parameter, values in _inner(optimizer).state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):  # SGD without momentum keeps a None
                state[f"{names[id(parameter)]}/{key}"] = value
    state[f"rng/rank_{rank}/torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state[f"rng/rank_{rank}/cuda"] = torch.cuda.get_rng_state()
    python = random.getstate()
    state[f"rng/rank_{rank}/python"] = torch.tensor([python[0], *python[1], -1 if python[2] is None else 0])
    state["progress/step"] = torch.tensor(step, dtype=torch.int64)
    state["progress/seed"] = torch.tensor(seed, dtype=torch.int64)
    return state


def save_checkpoint(
    root: Path, state: dict[str, torch.Tensor], *, step: int, rank: int, out_dir: Path, optimizer: str,
    device: torch.device, flags: dict[str, str] | None = None,
) -> Path:
    """Every rank calls this at the same step; returns ``root/step_<n>`` once it is complete.
    After each part that a rank may fail alone (rank 0 makes the folder, every rank hashes its
    files, rank 0 puts the save in place) the ranks agree whether all could (`_agree`, on
    ``device``, which the process group's backend must reach), so that one rank's failure ends
    every rank with one line rather than leaving the others waiting until --timeout.
    ``flags``: the train.py flags of the training recipe (`Recipe.flags`), recorded."""
    final, staging = step_folder(root, step), staging_folder(root, step)
    failure = ""
    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        except OSError as exc:
            failure = f"{staging} cannot be made ({exc.strerror or exc})"
    _agree(failure, device, step)
    dcp = _dcp()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)))
    try:
        write_digests(staging, rank, dist.get_world_size())
    except OSError as exc:
        failure = f"rank {rank} cannot hash its files in {staging} ({exc.strerror or exc})"
    _agree(failure, device, step)
    if rank == 0:
        try:
            write_record(staging, step=step, out_dir=out_dir, optimizer=optimizer, flags=flags or {},
                         world_size=dist.get_world_size())
            put_in_place(staging, final)
        except (OSError, ValueError, TypeError, CheckpointError) as exc:  # ValueError: a share's file unreadable
            failure = str(exc)
    _agree(failure, device, step)
    return final


def _agree(failure: str, device: torch.device, step: int) -> None:
    """Every rank learns whether any failed (``failure``: this one's reason, "" for none): all
    raise, the failed ones with their reason, the others pointing to it."""
    failed = torch.tensor([1 if failure else 0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failure:
        raise CheckpointError(f"the checkpoint of step {step} was not saved: {failure}")
    if failed.item():
        raise CheckpointError(f"the checkpoint of step {step} was not saved: another rank failed (its error says why)")


def checkpoint_keys(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor key of a checkpoint with its shape and dtype."""
    metadata = _safe_reader()(str(path)).read_metadata()
    return {
        key: (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "size")
    }


def load_tensors(path: Path, keys: Iterable[str], *, distributed: bool) -> dict[str, torch.Tensor]:
    """The named tensors of a checkpoint, freshly allocated."""
    shapes = checkpoint_keys(path)
    missing = [k for k in keys if k not in shapes]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {missing[0]!r}; it was saved by another compile or mesh")
    state = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        _dcp().load(state, storage_reader=_safe_reader()(str(path)), no_dist=not distributed)
    return state


def _state_device(optimizer: torch.optim.Optimizer, parameter: nn.Parameter, name: str) -> torch.device:
    """Where the optimizer keeps its state ``name`` of ``parameter``: beside the parameter, except
    AdamW's ``step`` counter, which stays on the CPU unless the group is fused or capturable
    (torch's own ``load_state_dict`` places it so)."""
    if name != "step":
        return parameter.device
    group = next((g for g in _inner(optimizer).param_groups if any(p is parameter for p in g["params"])), {})
    return parameter.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def _empty_state(parameter: nn.Parameter, saved: tuple, where: torch.device) -> torch.Tensor:
    """Where a saved optimizer state is read into: sharded like its parameter under FSDP, else whole."""
    shape, dtype = saved
    if is_sharded(parameter) and tuple(shape) == tuple(parameter.shape):
        return torch.empty_like(parameter.detach(), dtype=dtype)
    return torch.empty(shape, dtype=dtype, device=where)


def restore_checkpoint(
    path: Path, stages: dict[int, nn.Module], optimizer: torch.optim.Optimizer, *, rank: int, dp_rank: int,
    tp_rank: int, zero: int, seed: int, optimizer_name: str,
) -> int:  # fmt: skip
    """Load model, optimizer state, RNG states into this rank; return the number of steps done."""
    record = read_record(path)
    if record.get("optimizer") != optimizer_name:
        raise ConfigError(
            f"checkpoint {path} holds {record.get('optimizer')} state but --optimizer is {optimizer_name}; "
            f"resume with --optimizer {record.get('optimizer')}"
        )
    state = training_state(stages, optimizer, rank=rank, dp_rank=dp_rank, tp_rank=tp_rank, zero=zero, step=0, seed=0)
    state = {k: v for k, v in state.items() if not k.startswith("optim/")}
    shapes = checkpoint_keys(path)
    saved = _saved_optimizer_state(shapes)
    owned = {id(p) for group in _inner(optimizer).param_groups for p in group["params"]}
    held: dict[str, tuple[nn.Parameter, str]] = {}
    for s, module in stages.items():
        for name, parameter in module.named_parameters():
            if zero == 1 and id(parameter) not in owned:
                continue  # another replica steps it, and reads its state
            by_replica = saved.get((s, tp_rank, name), {})
            # ZeRO-1: the state where this replica saved it, else where another did (a partition
            # that differs from the saving run's: another torch's ZeroRedundancyOptimizer, say)
            found = by_replica.get(dp_rank if zero == 1 else None) or next(iter(by_replica.values()), {})
            for state_name, key in found.items():
                held[key] = (parameter, state_name)
                state[key] = _empty_state(parameter, shapes[key], _state_device(optimizer, parameter, state_name))
    for key in [k for k in state if k.startswith("rng/") and k not in shapes]:
        del state[key]  # a generator the saving run did not have (CUDA)
    missing = [k for k in state if k not in shapes]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {missing[0]!r}; it was saved by another compile or mesh")
    _dcp().load(state, storage_reader=_safe_reader()(str(path)))
    inner = _inner(optimizer)
    for key, (parameter, name) in held.items():  # read where they live: nothing to move one by one
        inner.state[parameter][name] = state[key]
    if isinstance(optimizer, ShardedMasters):  # the bf16 weights of the masters just read
        optimizer.gather_weights()
    if f"rng/rank_{rank}/torch" in state:
        torch.set_rng_state(state[f"rng/rank_{rank}/torch"])
    if f"rng/rank_{rank}/cuda" in state:
        torch.cuda.set_rng_state(state[f"rng/rank_{rank}/cuda"])
    if f"rng/rank_{rank}/python" in state:
        values = state[f"rng/rank_{rank}/python"].tolist()
        random.setstate((values[0], tuple(values[1:-1]), None))
    if int(state["progress/seed"]) != seed:
        raise ConfigError(
            f"checkpoint {path} was trained with --seed {int(state['progress/seed'])}, not {seed}; "
            f"resume with --seed {int(state['progress/seed'])}"
        )
    return int(state["progress/step"])


def restarted() -> bool:
    """True in a process that torchrun started again after a failure (``--max-restarts``)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


@dataclass(kw_only=True)
class CheckpointContext:
    """What the training loop needs to save and resume, gathered once."""

    root: Path | None
    out_dir: Path
    modules: dict[int, nn.Module]
    optimizer: torch.optim.Optimizer
    optimizer_name: str
    rank: int
    dp_rank: int
    tp_rank: int
    zero: int
    seed: int
    device: torch.device  # where the process group's backend takes tensors (`save_checkpoint`)
    flags: dict[str, str]  # the training recipe's train.py flags (`Recipe.flags`)

    def save(self, steps_done: int) -> Path:
        assert self.root is not None
        state = training_state(
            self.modules, self.optimizer, rank=self.rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank,
            zero=self.zero, step=steps_done, seed=self.seed,
        )  # fmt: skip
        return save_checkpoint(
            self.root, state, step=steps_done, rank=self.rank, out_dir=self.out_dir, optimizer=self.optimizer_name,
            device=self.device, flags=self.flags,
        )

    def resume(self) -> int:
        """Load the latest good checkpoint; the number of steps it had done (0 when there is none)."""
        assert self.root is not None
        path = self.chosen()
        if path is None:
            if self.rank == 0:
                print(f"autopart: no checkpoint in {self.root} yet; starting from step 0", flush=True)
            return 0
        record = read_record(path)
        if record.get("plan_sha256") != plan_digest(self.out_dir / "plan.json"):
            raise ConfigError(
                f"checkpoint {path} was saved by another compile than {self.out_dir}; resume it with the output "
                f"directory that saved it, or go on with this plan from its weights (the optimizer's state and the data "
                f"stream start anew): autopart consolidate {self.root} -o model.safetensors --model MODEL.py, then "
                "--weights model.safetensors with a new --checkpoint-dir"
            )
        done = restore_checkpoint(
            path, self.modules, self.optimizer, rank=self.rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank,
            zero=self.zero, seed=self.seed, optimizer_name=self.optimizer_name,
        )  # fmt: skip
        if self.rank == 0:
            print(f"autopart: resumed from {path} after step {done - 1}", flush=True)
            saved = record.get("flags") or {}  # none in a checkpoint of an earlier autopart: nothing to tell
            changed = Recipe.changed_flags(saved, self.flags)
            if saved and changed:
                print(f"autopart: note: {path.name} was saved by a run with {', '.join(changed)}; the training recipe "
                      "follows the flags given now", file=sys.stderr, flush=True)
        return done

    def chosen(self) -> Path | None:
        """The checkpoint to resume from: the first of rank 0's `candidates` (it lists them and
        tells the others, by broadcasts on `device`) that every rank finds whole, each reading
        its `share` of the files for their sha256, where one rank alone would read them all; None
        where there is none, an error where every one is damaged.
        (A --checkpoint-dir that is one checkpoint itself was refused at launch: `check_folder`.)"""
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        unreadable, steps = None, []
        if self.rank == 0:
            try:
                steps = [step_of(path) for path in (candidates(self.root) if self.root.is_dir() else [])]
                count[0] = len(steps)
            except OSError as exc:
                unreadable, count[0] = f"{self.root} cannot be read ({exc.strerror or exc})", -1
        dist.broadcast(count, src=0)
        if int(count.item()) < 0:
            raise CheckpointError(unreadable or f"rank 0 cannot read {self.root} (its error says why)")
        listed = torch.tensor(steps, dtype=torch.int64, device=self.device) if self.rank == 0 else \
            torch.zeros(int(count.item()), dtype=torch.int64, device=self.device)
        if len(listed):  # every one: "every checkpoint is damaged" is said of all of them
            dist.broadcast(listed, src=0)
        world_size = dist.get_world_size()
        for step in listed.tolist():
            path = step_folder(self.root, step)
            why = problem(path, self.rank, world_size)
            bad = torch.tensor([0 if why is None else 1], dtype=torch.int64, device=self.device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if not bad.item():
                return path
            if why is not None:
                say(f"autopart: {damaged(path, why)} (rank {self.rank})")  # every rank's, in one write
        if int(count.item()) > 0:  # going on from step 0 would leave their steps behind without a word
            raise CheckpointError(f"every checkpoint in {self.root} is damaged ({len(listed)} checked; the lines above "
                                  "say how), and --resume would start again from step 0; restore the folder from a "
                                  "copy, or drop --resume and give a new --checkpoint-dir to train afresh")
        return None

