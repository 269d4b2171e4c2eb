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
forwards, of every microbatch and replica, of what each left it at (the values averaged, not
their changes: a float mask's -inf minus itself would be NaN); what a recompute writes is
put back, since its forward already counted. The mean is the single process's update exactly
where the update is the same for every part of the batch (a counter, ``num_batches_tracked``)
or an affine function of the part's mean (BatchNorm's ``running_mean``, the parts being of one
size); BatchNorm's ``running_var`` becomes the mean of the parts' variances, which leaves out the
spread between the parts' means, as BatchNorm's normalisation by microbatch does (the compile
notes it). A floating buffer is averaged in fp64, an integer one rounded down, and a flag is set where
some forward set it.

Which buffers a forward updates is found by value over the first step (a kernel such as
``batch_norm`` writes its running statistics without bumping the tensor's version; a write through
a view shows in no schema), with those the stage file says its forward writes (``updated_buffers``:
`autopart.codegen.stages.updated_buffers`, which holds one that the first step leaves as it was),
agreed over the replicas, and only those are kept from then on. A buffer is written through ``.data``, which
leaves its version as it was: autograd saves BatchNorm's running statistics for its backward,
which in training reads none of them, and would refuse a tensor whose version moved (as
``batch_norm``'s own update leaves it); in the first step every buffer is put back, with its own
values where no forward changed it (a rotary table that autograd saved is left as it saved it);
and the capture refuses a model whose output reads a buffer that its forward updates, so no
backward reads a value that this puts back.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BufferUpdates", "stages_updated_buffers"]


class BufferUpdates:
    """The buffers of one stage module through a step (module docstring): `forward` around each
    F, `recompute` around each backward, `finish` after the step's last action."""

    def __init__(self, module: nn.Module, replicas: tuple[dist.ProcessGroup, int] | None = None,
                 updated: tuple[str, ...] | None = None):
        self.module = module
        self.replicas = replicas  # the data-parallel group and its size, over which the mean is also taken
        self.tracked: list[int] | None = None  # positions in module.buffers() that a forward updates; None: not known yet
        names = [name for name, _ in module.named_buffers()]
        # those the capture shows it write (a stage file's ``updated_buffers``), tracked whether or not they move at first
        self.written = {names.index(name) for name in updated or () if name in names}
        self.start: dict[int, torch.Tensor] = {}  # the step's starting values, by position
        self.sums: dict[int, torch.Tensor] = {}  # the sum over the step's forwards of the values each left
        self.changed: dict[int, torch.Tensor] = {}  # over the first step, whether some forward changed it (on the device)
        self.forwards = 0
        self.pending = False  # a forward ran whose updates are not collected yet

    def _buffers(self) -> list[torch.Tensor]:
        return list(self.module.buffers())

    def _watched(self) -> list[int]:
        buffers = self._buffers()
        return list(range(len(buffers))) if self.tracked is None else self.tracked

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """One microbatch's F: it starts from the step's values; its updates are counted."""
        if not self.start:
            buffers = self._buffers()
            self.start = {i: buffers[i].detach().clone() for i in self._watched() if _kept(buffers[i])}
        self._collect()
        yield
        self.forwards += 1
        self.pending = True

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """A backward, which may run the forward again: what it writes is put back."""
        self._collect()
        yield
        self._restore(count=False)

    def finish(self) -> None:
        """After the step: each updated buffer holds the mean of its forwards' values, over the
        replicas too."""
        if not self.start:
            return
        self._collect()
        buffers = self._buffers()
        if self.tracked is None:
            self._agree_on_tracked(len(buffers))
        # a flag is 1 where some forward set it, and its mean over the replicas above 0 where one did
        means = {i: self.sums[i].double() if self.sums[i].dtype == torch.bool else self.sums[i] / self.forwards
                 for i in self.start}  # the tracked buffers of numbers and flags
        if self.replicas is not None and means:
            group, size = self.replicas
            flat = torch.cat([mean.reshape(-1) for mean in means.values()])
            dist.all_reduce(flat, group=group)
            flat /= size
            offset = 0
            for i, mean in means.items():
                means[i] = flat[offset:offset + mean.numel()].view_as(mean)
                offset += mean.numel()
        with torch.no_grad():
            for i, mean in means.items():
                if buffers[i].dtype == torch.bool:
                    mean = mean > 0
                elif not buffers[i].is_floating_point():
                    mean = mean.floor()
                buffers[i].data.copy_(mean)
        self.start, self.sums, self.changed, self.forwards, self.pending = {}, {}, {}, 0, False

    def _collect(self) -> None:
        if self.pending:
            self._restore(count=True)
            self.pending = False

    def _restore(self, *, count: bool) -> None:
        """Put every watched buffer back to the step's start; ``count``: add the value the forward
        left to the sums (values, not changes: an infinite entry, a float mask's -inf, minus itself
        is NaN), and over the first step note on the device whether it moved, with no wait for it."""
        buffers = self._buffers()
        with torch.no_grad():
            for i, start in self.start.items():
                if count:
                    if buffers[i].dtype == torch.bool:  # a flag: whether some forward left it set, kept as flags
                        value = buffers[i].clone()
                        self.sums[i] = self.sums[i] | value if i in self.sums else value
                    else:
                        value = buffers[i].double()
                        self.sums[i] = self.sums[i] + value if i in self.sums else value
                    if self.tracked is None:
                        moved = _moved(buffers[i], start)
                        self.changed[i] = self.changed[i] | moved if i in self.changed else moved
                buffers[i].data.copy_(start)  # unversioned, and the same values where unchanged: module docstring

    def _agree_on_tracked(self, count: int) -> None:
        """After the first step: the buffers some forward changed on some replica."""
        device = next(iter(self.start.values())).device
        changed = torch.zeros(count, dtype=torch.int64, device=device)
        for i, moved in self.changed.items():
            changed[i] = moved
        if self.replicas is not None:
            dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.replicas[0])
        self.tracked = [i for i in range(count) if changed[i] or i in self.written]
        for i in list(self.start):
            if i not in self.tracked:
                del self.start[i]


def _moved(value: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Whether ``value`` differs from ``start`` anywhere (a NaN kept as NaN is no change)."""
    same = value.eq(start) | (value.isnan() & start.isnan()) if value.is_floating_point() else value.eq(start)
    return ~same.all()


def _kept(buffer: torch.Tensor) -> bool:
    """A buffer of real numbers or of flags, whose mean over the forwards says something (a flag
    is set after the step where some forward set it: a forward that sets an 'initialised' flag
    beside the buffer it initialises is put back with that buffer)."""
    return not buffer.is_complex()


def stages_updated_buffers(out_dir: Path) -> tuple[str, ...] | None:
    """The buffers that the stage files of ``out_dir`` say their forwards write, together (for a
    run of the whole model, as verify's reference is); None where a stage file says nothing (one
    written by an earlier autopart), to be found over the first step."""
    found: list[str] = []
    for path in sorted((out_dir / "stages").glob("stage_*.py")):
        said = [node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "updated_buffers" for t in node.targets)]
        if not said:
            return None
        found += ast.literal_eval(said[0])
    return tuple(dict.fromkeys(found))
