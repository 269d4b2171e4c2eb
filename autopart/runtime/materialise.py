"""Weights of a model built on the meta device, made where they are needed and nowhere else.

``materialise(model, names, init=...)`` allocates the tensors ``names`` of a meta model and
fills them with the model's own initialisers, one owning module at a time:

1. the model file's ``init_weights(module)``, when it defines one;
2. else the ``_init_weights(module)`` of the nearest enclosing module that has one (every
   Hugging Face ``PreTrainedModel`` does);
3. else the module's own ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, norms).

The random generator is seeded from the owning module's path before its initialiser runs, so a
module's values do not depend on which other modules the same process made: every pipeline
rank makes exactly its own slice, and the single-process reference makes the same values.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from autopart.ir.errors import ConfigError

__all__ = ["INIT_SEED", "materialise", "check_buffers_made", "check_initialisers", "meta_names"]

INIT_SEED = 0
"""Added to every module's seed; the same on every rank and in the reference."""

Init = Callable[[nn.Module], None] | None


def _owner_path(name: str) -> str:
    return name.rpartition(".")[0]


def meta_names(model: nn.Module) -> list[str]:
    """The parameters and buffers of ``model`` that are on the meta device (tied ones once per name)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [name for name, tensor in named if tensor.is_meta]


def _initialiser(model: nn.Module, path: str, init: Init) -> Callable[[], None] | None:
    module = model.get_submodule(path)
    if init is not None:
        return lambda: init(module)
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):  # the nearest enclosing module first
        holder = model.get_submodule(".".join(parts[:depth]))
        if callable(getattr(holder, "_init_weights", None)):
            return lambda: holder._init_weights(module)
    if callable(getattr(module, "reset_parameters", None)):
        return module.reset_parameters
    if not any(True for _ in module.parameters(recurse=False)):
        return lambda: None  # buffers only: nothing random to draw; one left without values is refused
    return None


def check_initialisers(model: nn.Module, init: Init, model_name: str) -> None:
    """Every module that holds meta parameters must have an initialiser; say which one does not."""
    for path in sorted({_owner_path(n) for n in meta_names(model)}):
        if _initialiser(model, path, init) is None:
            module = model.get_submodule(path)
            raise ConfigError(
                f"{model_name} builds the model on the meta device, but module '{path}' "
                f"({type(module).__name__}) has no reset_parameters() and {model_name} defines no "
                "init_weights(module); add one of them so that each rank can make its weights"
            )


def materialise(
    model: nn.Module, names: Iterable[str], *, init: Init = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Allocate and initialise the tensors ``names`` of the meta ``model``; return them by name.

    Tensors that share one parameter (tied embeddings) stay one tensor after materialising.
    """
    names = list(dict.fromkeys(names))
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    missing = [n for n in names if n not in named]
    if missing:
        raise ConfigError(f"the model has no tensor named {missing[0]!r}; recompile (the model file changed?)")
    aliases: dict[int, list[str]] = {}
    for name, tensor in named.items():
        aliases.setdefault(id(tensor), []).append(name)
    # a tied tensor is made by the owner of its first name, whichever of its names was asked for
    canonical = {name: aliases[id(named[name])][0] for name in names}
    for path in sorted({_owner_path(canonical[n]) for n in names if named[n].is_meta}):
        module = model.get_submodule(path)
        module.to_empty(device=device, recurse=False)
        initialise = _initialiser(model, path, init)
        if initialise is None:
            raise ConfigError(f"module '{path}' ({type(module).__name__}) has no initialiser; see check_initialisers")
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                if tensor.is_floating_point():
                    tensor.fill_(math.nan)  # what the initialiser leaves unset is told, not trained on
            torch.manual_seed(INIT_SEED + zlib.crc32(path.encode()))
            initialise()
    for name in names:
        tensor = _get(model, canonical[name])
        if tensor.is_floating_point() and tensor.numel() and bool(tensor.isnan().all()):
            raise ConfigError(_unset(name, tensor, model, init))
    result: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = _get(model, canonical[name])
        for alias in aliases[id(named[name])][1:]:  # re-tie what to_empty untied
            _set(model, alias, tensor)
        result[name] = tensor
    return result


def _unset(name: str, tensor: torch.Tensor, model: nn.Module, init: Init) -> str:
    """Why ``name`` of a meta model has no values after its module's initialiser ran, and the fix.

    A buffer computed in ``__init__`` (a Llama's rotary tables) is on the meta device too, with
    shape and no values; torch.empty's memory in its place trained on garbage (NaN losses)."""
    path = _owner_path(name)
    module = model.get_submodule(path)
    kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
    made_by = "init_weights(module)" if init is not None else "its initialiser (_init_weights or reset_parameters)"
    return (f"the model is built on the meta device, and {made_by} leaves {kind} '{name}' of module '{path}' "
            f"({type(module).__name__}) without values; set it there for that module"
            f"{', or compute it in forward' if kind == 'buffer' else ''}")


def check_buffers_made(model: nn.Module, init: Init) -> None:
    """Make the meta buffers of ``model`` (a copy's: they are small) as each rank will, to refuse
    at compile time one that its initialiser leaves without values (`materialise`)."""
    buffers = [name for name, b in model.named_buffers(remove_duplicate=False) if b.is_meta]
    if buffers:
        materialise(copy.deepcopy(model), buffers, init=init)


def _get(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner), leaf)


def _set(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        setattr(module, leaf, tensor)
