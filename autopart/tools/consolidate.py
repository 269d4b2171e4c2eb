"""Merge a training checkpoint into the original model's state dict, as one safetensors file.

Every stage's tensors carry their names in the original model, so consolidation is: read the
``model/`` keys of the checkpoint, put each tensor-parallel slice back together, keep one copy of
a parameter that several stages hold (a tied embedding), and fill in every name under which the
original model exposes it (``wte.weight`` and ``lm_head.weight``), so that
``build_model().load_state_dict(load_file(path))`` accepts the file with strict checking.

The model is built from the model file given with ``--model``, and from no other: a checkpoint
is data, and whoever hands one over must not be able to run code. So neither the copy of
``model.py`` inside a checkpoint folder is imported, nor the file that the checkpoint's own
``plan.json`` names (a forged plan could name any script here, with its true hash); the refusal
names that file, for the user to pass if it is theirs. The model is needed: the names under which
it exposes a tied parameter, the values of what no stage reads, its non-persistent buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from autopart.ir.model_file import load_model_file
from safetensors import SafetensorError, safe_open

from autopart.runtime.output_paths import check_parent, save_tensors
from autopart.ir.errors import ConfigError
from autopart.ir.placement import REPLICATE, Placement
from autopart.ir.plan import Plan, load_plan
from autopart.runtime.checkpoint import checkpoint_keys, load_tensors
from autopart.runtime.checkpoint_folders import RECORD, damaged, newest_intact, not_saved, read_record
from autopart.runtime.shards import unshard_weight

__all__ = ["Consolidated", "consolidate", "consolidated_state"]


@dataclass(frozen=True, kw_only=True)
class Consolidated:
    checkpoint: Path  # the step directory that was read
    step: int  # steps done when it was saved
    tensors: int
    skipped: tuple[str, ...]  # newer checkpoints passed over as damaged
    unread: tuple[str, ...] = ()  # the model's tensors that no stage reads: as build_model() makes them


def _model_file(plan: Plan, model: Path | None) -> Path:
    """The model file to build the model from: ``model``, the one the user named. The plan's own is
    only named in the refusal: the plan is the checkpoint's, and what it names is not run."""
    if model is None:
        named = plan.provenance.model_file
        raise ConfigError(f"consolidate imports only a model file given with --model: the checkpoint's plan names "
                          f"'{named}', but a checkpoint is data and what it names is not run; pass --model {named} "
                          "if that is the model file you compiled")
    if not Path(model).is_file():
        raise ConfigError(f"model file '{model}' does not exist; pass the model file that was compiled with --model")
    return Path(model)


def consolidated_state(checkpoint: Path, model: Path | None = None) -> tuple[dict[str, torch.Tensor], Consolidated]:
    """The original model's state dict from the latest good checkpoint under ``checkpoint``, built
    from ``model``, the model file the user gives (None is refused, naming the plan's)."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        raise ConfigError(f"checkpoint directory '{checkpoint}' is a file; pass the --checkpoint-dir of a run")
    if not checkpoint.is_dir():
        raise ConfigError(f"checkpoint directory '{checkpoint}' does not exist; pass the --checkpoint-dir of a run")
    path, passed = newest_intact(checkpoint)
    if path is None and passed and all(not_saved(folder) for folder, _ in passed):  # none is autopart's, damaged or not
        raise ConfigError(f"'{checkpoint}' holds no checkpoint ({passed[0][0].name} holds no {RECORD} and none of a "
                          "checkpoint's files); pass the --checkpoint-dir of a run")
    if path is None and passed:  # the --checkpoint-dir of a run, whose checkpoints were damaged after their save
        newest, why = passed[0]
        raise ConfigError(f"every checkpoint in '{checkpoint}' is damaged ({len(passed)} checked; the newest, "
                          f"{newest.name}: {why}); restore the folder from a copy")
    skipped = [damaged(folder, why) for folder, why in passed]
    if path is None:
        raise ConfigError(f"'{checkpoint}' holds no complete checkpoint; pass the --checkpoint-dir of a run")
    keys = [k for k in checkpoint_keys(path) if k.startswith("model/")]  # the metadata is checked first
    plan = load_plan(path / "plan.json")
    model_file = _model_file(plan, model)
    module = load_model_file(model_file).module
    tensors = load_tensors(path, keys, distributed=False)
    tp = plan.mesh["tp"]
    whole: dict[str, torch.Tensor] = {}
    for stage in plan.stages:
        placements = {name: Placement.parse(p) for name, p in stage.parameter_placements.items()}
        prefix = f"model/stage_{stage.index}/tp_0/"
        for name in (k.removeprefix(prefix) for k in keys if k.startswith(prefix)):
            if name not in whole:  # a tied parameter: every holder has the same values
                pieces = [tensors[f"model/stage_{stage.index}/tp_{r}/{name}"] for r in range(tp)]
                whole[name] = unshard_weight(pieces, placements.get(name, REPLICATE))
    assert module is not None
    held = module.state_dict(keep_vars=True)
    # a non-persistent buffer (register_buffer(..., persistent=False)) is a stage's, so a checkpoint
    # holds it, but the model's state dict leaves it out: so does the file
    for name, _ in module.named_buffers(remove_duplicate=False):
        if name not in held:
            whole.pop(name, None)
    _check_same_model(held, whole, model_file)
    aliases: dict[int, list[str]] = {}
    for name, value in held.items():
        aliases.setdefault(id(value), []).append(name)
    state: dict[str, torch.Tensor] = {}
    unread: list[str] = []
    for names in aliases.values():
        found = next((whole[n] for n in names if n in whole), None)
        if found is None and not held[names[0]].is_meta:
            # no stage reads it (a parameter no op uses; a counter the capture leaves out, as
            # BatchNorm's num_batches_tracked): no gradient, optimizer or op changed it, so it is as built
            found = held[names[0]]
            unread.append(names[0])
        if found is None:
            raise ConfigError(
                f"the checkpoint holds no values for {names[0]!r} of the model (no stage reads it, and it is built on "
                "the meta device); consolidate from a checkpoint of this model's compile"
            )
        for name in names:
            state[name] = found.detach().clone().contiguous()
    summary = Consolidated(checkpoint=path, step=int(read_record(path)["step"]), tensors=len(state),
                           skipped=tuple(skipped), unread=tuple(unread))
    return state, summary


def _check_same_model(held: dict[str, torch.Tensor], whole: dict[str, torch.Tensor], model_file: Path) -> None:
    """Refuse a model file (``--model``) whose state dict, ``held``, is not the one the checkpoint
    trained: a tensor the checkpoint holds that the model lacks, or holds at another shape, would
    write a file that its own ``load_state_dict`` refuses, or drop trained values without a word."""
    for name, value in whole.items():
        if name not in held:
            raise ConfigError(f"{model_file.name}'s model has no {name!r}, which the checkpoint holds; give the model "
                              "file that was compiled with --model")
        if tuple(held[name].shape) != tuple(value.shape):
            raise ConfigError(f"{model_file.name}'s model holds {name!r} at {tuple(held[name].shape)}, the checkpoint "
                              f"at {tuple(value.shape)}; give the model file that was compiled with --model")


def consolidate(checkpoint: Path, output: Path, model: Path | None = None) -> Consolidated:
    """Write the consolidated state dict to ``output`` (safetensors), replacing it atomically."""
    output = Path(output)
    if output.is_dir():
        raise ConfigError(f"output path '{output}' is a directory; give a file path such as model.safetensors")
    check_parent(output, "-o")
    _check_replaceable(output)
    state, summary = consolidated_state(checkpoint, model)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    save_tensors(state, partial, {"autopart_checkpoint": str(summary.checkpoint), "step": str(summary.step)})
    partial.replace(output)
    return summary


def _check_replaceable(output: Path) -> None:
    """Refuse an ``output`` that exists and that no consolidate wrote (its metadata names the
    checkpoint it came from): the user's own file (``-o model.py``, their weights) is not replaced."""
    if not output.exists() and not output.is_symlink():
        return
    try:
        with safe_open(str(output), framework="pt") as handle:
            written = "autopart_checkpoint" in (handle.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        written = False
    if not written:
        raise ConfigError(f"-o {output} exists and autopart consolidate did not write it; give a new path, or move "
                          "the file away first")
