"""Build a pipeline stage from its generated source file and its weights."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

__all__ = ["declare_tensors", "load_stage", "weights_file_name"]


def weights_file_name(stage: int, tp_rank: int, tp: int) -> str:
    """``stage_<k>.safetensors``, or ``stage_<k>.tp<r>.safetensors`` for each tensor-parallel rank."""
    return f"stage_{stage}.safetensors" if tp == 1 else f"stage_{stage}.tp{tp_rank}.safetensors"


def _owner(root: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``qualified`` (made as empty containers on the way), and the leaf name."""
    *path, leaf = qualified.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, leaf


def declare_tensors(
    module: nn.Module,
    parameters: dict[str, tuple[tuple[int, ...], torch.dtype]],
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> None:
    """Register empty parameters and buffers under their names in the original model.

    Keeping the original names (``h.0.attn.c_attn.weight``) makes every stage's state dict a
    slice of the original model's, so weights and checkpoints map back by name.
    """
    for name, (shape, dtype) in parameters.items():
        owner, leaf = _owner(module, name)
        owner.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype)))
    for name, (shape, dtype) in buffers.items():
        owner, leaf = _owner(module, name)
        owner.register_buffer(leaf, torch.empty(shape, dtype=dtype))


def load_stage(out_dir: Path, index: int, device: torch.device, *, tp_rank: int = 0, tp: int = 1) -> nn.Module:
    """Import ``stages/stage_<index>.py``, build the module and load this rank's weights."""
    path = out_dir / "stages" / f"stage_{index}.py"
    name = f"autopart_stage_{index}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    sys.modules[name] = source
    spec.loader.exec_module(source)
    stage = source.STAGE()
    weights = load_file(str(out_dir / "weights" / weights_file_name(index, tp_rank, tp)))
    stage.load_state_dict(weights, strict=True)
    return stage.to(device)
