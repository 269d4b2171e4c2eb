"""The refusals of what the options ask of the captured model, made right after the capture and
before any op is timed: the op timing (the default compile's, a ``--costs`` file's, a search's)
runs every op's kernels, minutes on a large model, all thrown away by a refusal that the capture
and the options alone could make.

- a loss summed over the batch, where the options already say that the plan will split the batch
  (`autopart.passes.loss_reduction` says why such a plan trains another loss);
- a ZeRO level whose FSDP cannot shard a parameter that the captured graph holds (`check_shardable`);
- pinned layers per stage (``--stage-layers``) that the model's repeated layers cannot meet;
- a model file that imports a module from beside it under a name the output directory keeps for
  its own files (`check_files_beside`), which emitting, the compile's last step, refused.

And one warning, which the compile gives once (`autopart.driver.measured_plan`), not at each capture:
parameters of half precision in a plan of fp32 (`warn_of_half_parameters`).
"""

from __future__ import annotations

import logging

import torch

from autopart.codegen.output_dir import check_files_beside
from autopart.ir.errors import ConfigError
from autopart.ir.model_file import ModelSpec
from autopart.options import CompileOptions
from autopart.passes.capture import Graph
from autopart.passes.loss_reduction import SUM, summed_loss_error
from autopart.runtime.fully_sharded import check_shardable
from autopart.solve.stage_layers import check_captured_layers

__all__ = ["check_split_asked", "refuse_early", "warn_of_half_parameters"]

_LOG = logging.getLogger("autopart.passes.early_refusals")


def refuse_early(options: CompileOptions, graph: Graph, spec: ModelSpec) -> None:
    """Refuse, in one line, what ``options`` ask of the model ``graph`` captures (from ``spec``)
    that it cannot do, and a model file whose output directory could not be written."""
    check_files_beside(spec)
    check_split_asked(options, graph.loss_reduction, spec.path.name)
    refused = check_shardable(graph.module, options.zero or 0)
    if refused:
        raise ConfigError(refused)
    if options.stage_layers is not None:
        check_captured_layers(graph.module.graph, options.stage_layers)


def warn_of_half_parameters(options: CompileOptions, spec: ModelSpec) -> None:
    """Warn of a model built in half precision (``.half()``) for a plan of fp32: train.py steps its
    parameters in their own dtype, with no fp32 master copy, and a plain fp16 AdamW goes to loss nan
    within steps, where the plan and its report say fp32."""
    if options.dtype not in (None, "fp32"):
        return
    half = next(((name, p.dtype) for name, p in spec.module.named_parameters()
                 if p.dtype in (torch.float16, torch.bfloat16)), None)
    if half is not None:
        _LOG.warning(f"build_model() of {spec.path.name} gives {str(half[1]).removeprefix('torch.')} parameters "
                     f"(first {half[0]!r}), which train.py updates in that dtype, without fp32 master weights (fp16 "
                     "AdamW soon trains to loss nan); build the model in fp32 and compile with --dtype bf16 for mixed "
                     "precision")


def check_split_asked(options: CompileOptions, reduction: str, model_file: str) -> None:
    """Refuse a loss that sums over the batch where ``options`` already say that the plan will
    split the batch: a layout given in full (or a plan file's) that runs it in several microbatches
    or replicas, and a search not pinned to one microbatch of one replica (whose finalists would
    run here too, before `check_mean_loss` judged the plan made)."""
    if reduction != SUM:
        return
    if not options.searched:
        total, _, micro = options.batch_shape()
        pieces = total // micro
        if pieces > 1:
            raise summed_loss_error(model_file, f"the plan splits each batch of {total} into {pieces} of {micro}",
                                    f"1/{pieces}")
        return
    total = options.global_batch_size
    one_microbatch = options.microbatches == 1 or options.micro_batch_size == total
    # dp is 1 where pinned so, or where the pinned pp and tp fill the world (dp = world / (pp x tp))
    one_replica = options.dp == 1 or (options.world_size or 1) <= (options.pp or 1) * (options.tp or 1)
    if total is None or total == 1 or (one_replica and one_microbatch):
        return  # nothing the search may choose splits the batch (the search refuses a missing global batch)
    whole = options.dp in (None, 1) and options.microbatches in (None, 1) and options.micro_batch_size in (None, total)
    split = f"the search splits each batch of {total} into microbatches or data-parallel replicas"
    raise summed_loss_error(model_file, split, "a fraction",
                            ", or keep each batch whole with --microbatches 1 --dp 1" if whole else "")
