"""A loss summed over the batch, refused where the compile's options already say that its plan will
split the batch (`autopart.passes.loss_reduction` says why such a plan trains another loss): right
after the capture, which tells how the loss reduces, and before any op is timed."""

from __future__ import annotations

from autopart.options import CompileOptions
from autopart.passes.loss_reduction import SUM, summed_loss_error

__all__ = ["check_split_asked"]


def check_split_asked(options: CompileOptions, reduction: str, model_file: str) -> None:
    """Refuse a loss that sums over the batch where ``options`` already say that the plan will
    split the batch: a layout given in full (or a plan file's) that runs it in several microbatches
    or replicas, and a search not pinned to one microbatch of one replica. Called right after the
    capture, which tells the reduction, so that a model that will be refused is not timed first
    (its ops, a search's finalists: minutes); `check_mean_loss` judges the plan made."""
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
    if total is None or total == 1 or (options.dp == 1 and one_microbatch):
        return  # nothing the search may choose splits the batch (the search refuses a missing global batch)
    whole = options.dp in (None, 1) and options.microbatches in (None, 1) and options.micro_batch_size in (None, total)
    split = f"the search splits each batch of {total} into microbatches or data-parallel replicas"
    raise summed_loss_error(model_file, split, "a fraction",
                            ", or keep each batch whole with --microbatches 1 --dp 1" if whole else "")
