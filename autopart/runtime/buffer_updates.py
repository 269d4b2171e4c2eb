"""What a training step leaves in the buffers that a forward updates in place (a step counter's
``self.steps.add_(1)``, BatchNorm's running statistics and ``num_batches_tracked``).

The programs must train the model that one process trains on the same batches, and that process
runs one forward per step, over the whole global batch: a counter advances by one per step, a
running mean moves once towards the batch's mean. A pipeline runs a stage's forward once per
microbatch, on every replica, and once more in each recompute, so left alone a counter would
advance by the microbatches of a step, twice that under recompute, and depend on the plan.

So within a step every forward reads the buffers as they were at the step's start, as the one
forward of the single process does (a forward that reads its counter reads the same value in
every microbatch), and after the step each updated buffer holds the mean over the step's
forwards, of every microbatch and replica, of what each left it at (a float's values averaged,
not their changes: a float mask's -inf minus itself would be NaN; an integer's values as their
high and low 32-bit halves, whose sums do not overflow where the values' own would: `_integer_mean`);
what a recompute writes is put back, since its forward already counted. The mean is the single process's update exactly
where the update is the same for every part of the batch (a counter, ``num_batches_tracked``)
or an affine function of the part's mean (BatchNorm's ``running_mean``, the parts being of one
size); BatchNorm's ``running_var`` becomes the mean of the parts' variances, which leaves out the
spread between the parts' means, as BatchNorm's normalisation by microbatch does (the compile
notes it). A floating buffer is averaged in its own dtype (fp32 for a 16-bit one: `_accumulating`),
an integer one rounded down, and a flag is set where some forward set it.

Which buffers a forward updates is what the stage file says (``updated_buffers``,
`autopart.codegen.stages.updated_buffers`): those the captured graph writes, through any view
(`autopart.passes.buffer_writes`), and every buffer of a --leaf module, whose code is unseen. No
other buffer is touched, so a buffer's update that first comes in a later step (an average gated
on a counter) is tracked from the first, and a stage file of an earlier autopart, which says
nothing, has all its buffers tracked. Each tracked buffer costs, through a step, a copy of its
starting values and the sum of its forwards' values: twice its bytes, three times a 16-bit
float's, 17 times an int8 counter's (two int64 halves). The memory model counts them on the
stage that holds the buffer (`autopart.predict.memory.held_buffer_bytes`, which a test holds to
what this class keeps).

A buffer is written through ``.data``, which leaves its version as it was: autograd saves
BatchNorm's running statistics for its backward, which in training reads none of them, and
would refuse a tensor whose version moved (as ``batch_norm``'s own update, which bumps no
version, leaves it); and the capture refuses a model whose output reads a buffer that its
forward updates, so no backward reads a value that this puts back.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BufferUpdates", "stages_updated_buffers", "summed_bytes"]


class BufferUpdates:
    """The buffers of one stage module through a step (module docstring): `forward` around each
    F, `recompute` around each backward or each recompute inside one, `finish` after the step's
    last action."""

    def __init__(self, module: nn.Module, replicas: tuple[dist.ProcessGroup, int] | None = None,
                 updated: tuple[str, ...] | None = None):
        self.module = module
        self.replicas = replicas  # the data-parallel group and its size, over which the mean is also taken
        # positions in module.buffers() that a forward writes: the stage file's ``updated_buffers``;
        # without it (a stage file of an earlier autopart), every buffer
        self.tracked = [i for i, (name, buffer) in enumerate(module.named_buffers())
                        if (updated is None or name in updated) and _kept(buffer)]
        self.start: dict[int, torch.Tensor] = {}  # the step's starting values, by position
        self.sums: dict[int, torch.Tensor] = {}  # the sum over the step's forwards of what each left (`_restore`)
        self.forwards = 0
        self.pending = False  # a forward ran whose updates are not collected yet

    def _buffers(self) -> list[torch.Tensor]:
        return list(self.module.buffers())

    def tracked_buffers(self) -> list[torch.Tensor]:
        """The buffers a forward writes, as the module holds them now."""
        buffers = self._buffers()
        return [buffers[i] for i in self.tracked]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """One microbatch's F: it starts from the step's values; its updates are counted."""
        if not self.tracked:
            yield
            return
        if not self.start:
            buffers = self._buffers()
            self.start = {i: buffers[i].detach().clone() for i in self.tracked}
        self._collect()
        yield
        self.forwards += 1
        self.pending = True

    def recompute(self) -> contextlib.AbstractContextManager:
        """Around a backward, or a recompute inside one: the forwards' updates are counted first,
        and what the recompute writes is put back on leaving, even by an exception (a checkpoint
        stops its recompute early by one). The one object may be entered again, and nested: a
        checkpoint enters its recompute context in each backward that recomputes (torch's
        zero-bubble W pass recomputes after I, whatever the stage ran between them)."""
        return _PutBack(self)

    def finish(self) -> None:
        """After the step: each updated buffer holds the mean of its forwards' values, over the
        replicas too."""
        if not self.start:
            return
        self._collect()
        if self.replicas is not None:
            self._sum_over_replicas()
        forwards = self.forwards * (self.replicas[1] if self.replicas is not None else 1)
        buffers = self._buffers()
        with torch.no_grad():
            for i, total in self.sums.items():
                if buffers[i].dtype == torch.bool:  # a flag: set where some forward set it
                    mean = total > 0
                elif buffers[i].is_floating_point():
                    mean = total / forwards
                else:
                    mean = _integer_mean(total, forwards)
                buffers[i].data.copy_(mean)
        self.start, self.sums, self.forwards, self.pending = {}, {}, 0, False

    def _sum_over_replicas(self) -> None:
        """The sums over every replica's forwards, one all-reduce per accumulating dtype."""
        group = self.replicas[0]
        for dtype in dict.fromkeys(total.dtype for total in self.sums.values()):
            same = [i for i, total in self.sums.items() if total.dtype == dtype]
            flat = torch.cat([self.sums[i].reshape(-1) for i in same])
            dist.all_reduce(flat, group=group)
            offset = 0
            for i in same:
                self.sums[i] = flat[offset:offset + self.sums[i].numel()].view_as(self.sums[i])
                offset += self.sums[i].numel()

    def _collect(self) -> None:
        if self.pending:
            self._restore(count=True)
            self.pending = False

    def _restore(self, *, count: bool) -> None:
        """Put every tracked buffer back to the step's start; ``count``: add what the forward left
        to the sums: a float's value (not its change: an infinite entry, a float mask's -inf, minus
        itself is NaN), an integer's value in two halves (`_integer_mean`), a flag's value."""
        buffers = self._buffers()
        with torch.no_grad():
            for i, start in self.start.items():
                if count:
                    left = buffers[i]
                    if not (left.is_floating_point() or left.dtype == torch.bool):
                        value = left.to(torch.int64)
                        left = torch.stack((value >> 32, value & 0xFFFFFFFF))
                    if i in self.sums:
                        self.sums[i].add_(left)  # in place, promoted: no copy of a 16-bit buffer beside the sum
                    else:
                        self.sums[i] = left.to(_accumulating(left.dtype), copy=True)
                buffers[i].data.copy_(start)  # unversioned, and the same values where unchanged: module docstring


class _PutBack(contextlib.AbstractContextManager):
    """`BufferUpdates.recompute`'s context: reusable, unlike a generator's."""

    def __init__(self, updates: BufferUpdates):
        self.updates = updates

    def __enter__(self) -> None:
        self.updates._collect()

    def __exit__(self, *exc: object) -> None:
        self.updates._restore(count=False)


def _integer_mean(halves: torch.Tensor, count: int) -> torch.Tensor:
    """The mean, rounded down, of ``count`` int64 values from the sums of their high halves
    (``value >> 32``) and low halves (``value & 0xFFFFFFFF``): the values' own sum overflows int64
    where they lie near its ends (a counter near 2**63, a sentinel at -2**63 that a forward
    replaces, or a sum of changes from it), and neither half's sum does. With
    ``high = q * count + r``, the mean is ``q * 2**32 + (r * 2**32 + low) // count``, each term
    within int64 for any count below 2**30."""
    high, low = halves
    quotient, remainder = torch.div(high, count, rounding_mode="floor"), torch.remainder(high, count)
    return quotient * 2**32 + torch.div(remainder * 2**32 + low, count, rounding_mode="floor")


def summed_bytes(dtype: torch.dtype) -> int:
    """The bytes per element of a tracked buffer's sum over a step's forwards (`_restore`): an
    integer's two int64 halves (`_integer_mean`), else one value in `_accumulating`'s dtype. The
    memory model charges a stage what this class keeps (`autopart.predict.memory.held_buffer_bytes`)."""
    halves = 1 if dtype.is_floating_point or dtype == torch.bool else 2
    return halves * _accumulating(dtype).itemsize


def _accumulating(dtype: torch.dtype) -> torch.dtype:
    """The dtype a buffer's values are summed in over a step's forwards: its own where that holds
    the sum of a few of its values about as well as it holds one (fp32, fp64), fp32 for a 16-bit
    float, int64 for an integer (an int8 counter summed over a few hundred microbatches would
    wrap) and for a flag, whose sum counts the forwards that set it."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype.is_floating_point:
        return dtype
    return torch.int64


def _kept(buffer: torch.Tensor) -> bool:
    """A buffer of real numbers or of flags, whose mean over the forwards says something (a flag
    is set after the step where some forward set it: a forward that sets an 'initialised' flag
    beside the buffer it initialises is put back with that buffer)."""
    return not buffer.is_complex()


def stages_updated_buffers(out_dir: Path) -> tuple[str, ...] | None:
    """The buffers that the stage files of ``out_dir`` say their forwards write, together (for a
    run of the whole model, as verify's reference is); None where a stage file says nothing (one
    written by an earlier autopart): every buffer is then tracked."""
    found: list[str] = []
    for path in sorted((out_dir / "stages").glob("stage_*.py")):
        said = [node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "updated_buffers" for t in node.targets)]
        if not said:
            return None
        found += ast.literal_eval(said[0])
    return tuple(dict.fromkeys(found))
