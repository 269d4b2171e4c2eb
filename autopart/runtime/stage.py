"""Build a pipeline stage from its generated source file and its weights."""

from __future__ import annotations

import copy
import functools
import hashlib
import sys
import types
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from autopart.ir.errors import ConfigError

if TYPE_CHECKING:
    from autopart.ir.plan import Plan

__all__ = [
    "declare_tensors",
    "declare_leaves",
    "model_attribute",
    "load_stage",
    "stage_names",
    "state_names",
    "check_checkpoint",
    "model_shapes",
    "read_checkpoint",
    "tensor_aliases",
    "checked_stage_source",
    "Container",
]


class Container(nn.Module):
    """A module that only holds others, as the model's path to a tensor: ``layers`` of ``layers.0.attention``.

    It indexes its numbered children (``self.layers[0]``), so the generated code reads as the
    model's own ``nn.ModuleList`` would; its state dict is its children's, under the same names.
    """

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]


def _owner(root: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``qualified`` (made as empty containers on the way), and the leaf name."""
    *path, leaf = qualified.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = Container()
            module.add_module(part, child)
        module = child
    return module, leaf


def declare_tensors(
    module: nn.Module,
    parameters: dict[str, tuple[tuple[int, ...], torch.dtype]],
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype]],
    constants: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    frozen: tuple[str, ...] = (),
) -> None:
    """Register empty parameters and buffers under their names in the original model; those
    ``frozen`` (``requires_grad=False`` in the model) as it has them: no gradient reaches them,
    so no optimizer steps them, no reduction sums them.

    Keeping the original names (``h.0.attn.c_attn.weight``) makes every stage's state dict a
    slice of the original model's, so weights and checkpoints map back by name.
    """
    for name, (shape, dtype) in parameters.items():
        owner, leaf = _owner(module, name)
        owner.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=name not in frozen))
    for name, (shape, dtype) in buffers.items():
        owner, leaf = _owner(module, name)
        owner.register_buffer(leaf, torch.empty(shape, dtype=dtype))
    for name, (shape, dtype) in (constants or {}).items():  # part of the program, not of the model's state
        owner, leaf = _owner(module, name)
        owner.register_buffer(leaf, torch.empty(shape, dtype=dtype), persistent=False)


@functools.cache
def _meta_spec(model_file: Path):
    """The model file, its model built on the meta device: the source of --leaf modules and of the
    initialisers of a meta model (which must come from the same import as the model's classes)."""
    from autopart.ir.model_file import load_model_file

    with torch.device("meta"):
        spec = load_model_file(model_file)
    assert spec.module is not None
    return spec


def _meta_model(model_file: Path) -> nn.Module:
    return _meta_spec(model_file).module


def model_attribute(model_file: Path, qualified_name: str) -> Any:
    """A function or class of the model file that the stage's code calls (an ``fx.wrap``
    function, the dataclass or NamedTuple its forward returns), from ``model_file`` as imported
    here (once per process, with the folder it sits in on the path, as the compile imports it)."""
    return functools.reduce(getattr, qualified_name.split("."), _model_module(_compiled(model_file)))


def _compiled(model_file: Path) -> Path:
    """The model file that a stage names as OUT's ``model.py``: the one compiled while it is
    unchanged (`_model_source`), as the data and the loss are taken, so that the classes its
    forward returns are the ones its loss knows (OUT's copy carries the files beside it too)."""
    out_dir = model_file.parent
    return _model_source(out_dir) if model_file.name == "model.py" and (out_dir / "plan.json").is_file() else model_file


@functools.cache
def _model_module(model_file: Path) -> types.ModuleType:
    from autopart.ir.model_file import import_name, load_model_file

    load_model_file(model_file, build=False)
    return sys.modules[import_name(model_file)]


def declare_leaves(module: nn.Module, leaves: dict[str, str], model_file: Path) -> None:
    """Register the ``--leaf`` modules under their paths in the original model.

    Each one is taken from ``build_model()`` of ``model_file`` run on the meta device (so no
    weights are made for the rest of the model), then given empty storage; the stage's weights
    fill it like every other tensor.
    """
    model = _meta_model(_compiled(model_file))
    for path, class_name in leaves.items():
        leaf = copy.deepcopy(model.get_submodule(path))
        if type(leaf).__name__ != class_name:
            raise ConfigError(
                f"{model_file.name} now builds a {type(leaf).__name__} at '{path}', not the {class_name} this stage "
                "was compiled with; recompile"
            )
        owner, name = _owner(module, path)
        owner.add_module(name, leaf.to_empty(device="cpu"))


def stage_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a stage by name, non-persistent buffers included."""
    return dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))


def read_checkpoint(path: Path, names: list[str],
                    aliases: dict[str, tuple[str, ...]] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` from a safetensors checkpoint, reading those and no others; a tied
    tensor under whichever of its ``aliases`` the file holds it by."""
    with safe_open(str(path), framework="pt", device="cpu") as checkpoint:
        held = set(checkpoint.keys())
        return {name: checkpoint.get_tensor(_stored_name(name, held, aliases or {})) for name in names}


def tensor_aliases(out_dir: Path) -> dict[str, tuple[str, ...]]:
    """Per name of a tied tensor, every name the model holds it by, the name itself first: a
    checkpoint written by Hugging Face's ``save_pretrained`` keeps a tied head only under its
    embedding's name, where the plan may name it by the head's."""
    names: dict[int, list[str]] = {}
    for name, tensor in stage_tensors(_meta_model(_model_source(out_dir))).items():
        names.setdefault(id(tensor), []).append(name)
    return {name: (name, *(other for other in tied if other != name))
            for tied in names.values() if len(tied) > 1 for name in tied}  # fmt: skip


def _stored_name(name: str, held: Collection[str], aliases: dict[str, tuple[str, ...]]) -> str:
    return next((alias for alias in aliases.get(name, ()) if alias in held), name)


def check_checkpoint(path: Path, names: list[str], stage: int, shapes: dict[str, tuple[int, ...]] | None = None,
                     aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """Refuse, before training starts, a checkpoint that lacks some of a stage's tensors (under
    every one of its ``aliases``), or holds one at another shape than ``shapes`` (the model's,
    whole: a rank copying it failed on a bare size mismatch, its peers on a closed connection)."""
    if not path.is_file():
        raise ConfigError(f"weights file '{path}' does not exist; pass a safetensors file of the model's weights")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as checkpoint:
            held = {name: tuple(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise ConfigError(f"weights file '{path}' is not a safetensors file ({exc}); pass a safetensors file") from None
    stored = {name: _stored_name(name, held.keys(), aliases or {}) for name in names}
    missing = [n for n in names if stored[n] not in held]
    if missing:
        raise ConfigError(
            f"weights file '{path}' lacks {len(missing)} tensor(s) of stage {stage}, first {missing[0]!r}; "
            "save every parameter under its name in the original model (model.state_dict())"
        )
    for name in names:
        if shapes is not None and name in shapes and held[stored[name]] != shapes[name]:
            raise ConfigError(f"weights file '{path}' holds {stored[name]!r} at {held[stored[name]]}, where the model compiled holds "
                              f"it at {shapes[name]}; give the weights of that model (its model.state_dict())")


def model_shapes(out_dir: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of the compiled model's tensors by name, whole (before any tensor-parallel slice)."""
    model = _meta_model(_model_source(out_dir))
    return {name: tuple(tensor.shape) for name, tensor in stage_tensors(model).items()}


def stage_names(out_dir: Path, index: int) -> list[str]:
    """The names of the tensors that stage ``index`` holds, from its generated source."""
    source = _stage_source(out_dir, index)
    names = [*source.PARAMETERS, *source.BUFFERS]
    model_file = _model_source(out_dir)
    for path in getattr(source, "LEAVES", {}):
        leaf = _meta_model(model_file).get_submodule(path)
        names.extend(f"{path}.{name}" for name in stage_tensors(leaf))
    return names


def state_names(out_dir: Path, index: int) -> list[str]:
    """The names of stage ``index``'s tensors that a state dict of the model holds, those a
    ``--weights`` checkpoint gives: all of `stage_names` but the model's non-persistent buffers
    (``register_buffer(..., persistent=False)``, a Llama's rotary tables), which
    ``model.state_dict()`` leaves out; the stage has them from ``weights/`` or the model's init."""
    transient = _transient_buffers(_model_source(out_dir))
    return [name for name in stage_names(out_dir, index) if name not in transient]


def _model_source(out_dir: Path) -> Path:
    """The model file to build the model from: the original while it is the file compiled (its
    imports of files beside it work), else the copy in OUT, as the data is taken (`data.model_file`)."""
    from autopart.ir.plan import load_plan
    from autopart.runtime.data import model_file

    return model_file(out_dir, load_plan(out_dir / "plan.json"))


@functools.cache
def _transient_buffers(model_file: Path) -> frozenset[str]:
    model = _meta_model(model_file)
    return frozenset(name for name, _ in model.named_buffers(remove_duplicate=False)) - set(model.state_dict())


def checked_stage_source(out_dir: Path, plan: Plan, index: int) -> bytes:
    """The bytes of ``stages/stage_<index>.py``, once they are known to be the ones the compile wrote.

    A rank executes its stage file: a file changed since the compile (by hand, by another compile,
    by whoever could write the folder) would run unchecked code beside weights that it does not fit.
    """
    relative = f"stages/stage_{index}.py"
    source = (out_dir / relative).read_bytes()
    expected = plan.stage_sha256.get(relative)
    if expected is None:
        raise ConfigError(f"plan.json of {out_dir} records no sha256 of {relative} (an older compile); "
                          "recompile with autopart compile")
    if hashlib.sha256(source).hexdigest() != expected:
        raise ConfigError(f"{relative} in {out_dir} is not the file that autopart compile wrote (its sha256 differs "
                          "from plan.json's); recompile with autopart compile instead of editing it")
    return source


def _stage_source(out_dir: Path, index: int):
    digest = hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:12]
    name = f"autopart_stage_{index}_{digest}"  # one per output directory: a process may read several
    if name in sys.modules:
        return sys.modules[name]
    from autopart.ir.plan import load_plan

    path = out_dir / "stages" / f"stage_{index}.py"
    code = compile(checked_stage_source(out_dir, load_plan(out_dir / "plan.json"), index), str(path), "exec")
    source = types.ModuleType(name)  # executed from the checked bytes: no second read, no bytecode cache in OUT
    source.__file__ = str(path)
    sys.modules[name] = source
    exec(code, source.__dict__)
    return source


def load_stage(
    out_dir: Path,
    index: int,
    device: torch.device,
    *,
    tp_rank: int = 0,
    tp: int = 1,
    weights: Path | None = None,
    placements: dict[str, str] | None = None,
) -> nn.Module:
    """Build stage ``index`` from ``stages/stage_<index>.py`` and give it this rank's weights.

    The weights come from ``weights`` (a safetensors checkpoint of the whole model, read by
    name) when given, else from ``weights/stage_<index>[.tp<r>].safetensors``, else, for a model
    built on the meta device, from the model's own initialisers run for this stage's tensors
    alone. Whole tensors are sliced for this tensor-parallel rank by their ``placements``.
    """
    from autopart.ir.placement import REPLICATE, Placement
    from autopart.runtime.shards import shard_weight, weights_file_name

    stage = _stage_source(out_dir, index).STAGE()
    tensors = stage_tensors(stage)
    written = out_dir / "weights" / weights_file_name(index, tp_rank, tp)
    values = load_file(str(written)) if written.is_file() else {}  # a meta model's holds its constants only
    own = stage_names(out_dir, index)
    whole: dict[str, torch.Tensor] = {}
    if weights is not None:
        whole.update(read_checkpoint(weights, state_names(out_dir, index), tensor_aliases(out_dir)))
    missing = [name for name in own if name not in values and name not in whole]
    if missing:
        from autopart.runtime.materialise import materialise

        spec = _meta_spec(_model_source(out_dir))
        whole.update(materialise(copy.deepcopy(spec.module), missing, init=spec.init_weights))
    placed = {name: Placement.parse(p) for name, p in (placements or {}).items()}
    for name, tensor in whole.items():
        values[name] = shard_weight(tensor, placed.get(name, REPLICATE), tp, tp_rank)
    missing = set(tensors) - set(values)
    if missing:
        raise ConfigError(f"the weights of stage {index} lack {sorted(missing)[0]!r}; recompile")
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(values[name])
    return stage.to(device)

