"""Where a rank computes, which backend its process groups use, and how its clock waits for it.

This is the one module of the runtime that knows about CUDA: the rest asks it for the rank's
compute device, puts every tensor that a collective or a message carries on that device, and
reads time through it. NCCL moves only CUDA tensors and gloo (here) only CPU ones, so a tensor
made without a device (``torch.tensor([x])``, on the CPU) fails on an NCCL group at its first
collective; `tensor` makes the small tensors the step loop reduces on the compute device.

On a GPU the host runs ahead of the kernels it launches: a clock read after a launch measures
the launch. `StepTimer` therefore synchronises the device at the end of a step, and at its start
where what was launched since the previous step's end is not this step's to time, and times
actions with CUDA events, which the GPU records in stream order, resolved once after the step
(one host sync per step instead of one per action).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist

from autopart.ir.errors import ConfigError

__all__ = ["compute_device", "backend", "tensor", "on_device", "batch_on_device", "synchronize", "barrier",
           "reset_peak_memory", "peak_memory_bytes", "peak_reserved_bytes", "peak_memory_per_rank", "Mark",
           "StepTimer"]


def compute_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) when CUDA is present, else the CPU;
    the one GPU it sees where a launcher other than torchrun (no ``LOCAL_WORLD_SIZE``) gives each
    process a GPU of its own (``srun --gpus-per-task=1``). Started by ``srun`` itself, which sets
    ``SLURM_LOCALID`` and not ``LOCAL_RANK``, a rank that sees its node's every GPU takes the one
    of its place on the node: all of them on GPU 0 would end in NCCL's "Duplicate GPU detected"."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    count = torch.cuda.device_count()
    if count == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        local_rank = 0
    if local_rank >= count:
        raise ConfigError(
            f"local rank {local_rank} has no GPU of its own ({count} visible); start at most {count} processes "
            "per node, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every rank on the CPU with gloo"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # NCCL's object collectives and barriers use the current device
    return device


def backend(device: torch.device) -> str:
    """The process-group backend for tensors on ``device``: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def tensor(values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A small tensor of host values on the compute device, to be reduced over a process group."""
    return torch.tensor(values, dtype=dtype, device=device)


def on_device(value: Any, device: torch.device) -> Any:
    """A batch value on ``device`` (anything but a tensor as it is). To a GPU the copy is made
    from pinned memory and does not wait: a copy from pageable memory first waits for every
    kernel queued on the stream, so the host would stop there and the GPU then idle while the
    next kernels were launched."""
    if not isinstance(value, torch.Tensor):
        return value
    if device.type == "cuda" and value.device.type == "cpu":
        value = value.pin_memory()
    return value.to(device, non_blocking=True)  # itself where it is there already


def batch_on_device(microbatches: list[tuple[Any, ...]], read: set[int], device: torch.device) -> list[tuple[Any, ...]]:
    """A step's microbatches with the values at positions ``read`` (those this rank's stages
    read) `on_device`, the rest as they are: one copy of each per step, before its first action,
    not one per forward."""
    return [tuple(on_device(v, device) if i in read else v for i, v in enumerate(values)) for values in microbatches]


def synchronize(device: torch.device) -> None:
    """Wait until every kernel launched on ``device`` has run (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device: torch.device) -> None:
    """Every rank of the world group waits for the others; on a GPU the barrier's tensor on this
    rank's own (torch otherwise guesses the current device, and warns that it did)."""
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def reset_peak_memory(device: torch.device) -> None:
    """Start a GPU's peak over, before the first step, so that `peak_memory_bytes` is training's:
    what the rank held as it started (the weights loaded, fp32 masters made beside the bf16
    copies) is not what the plan predicts. The CPU's resident peak cannot be started over."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The peak so far: bytes allocated on a GPU since `reset_peak_memory`, resident memory of the
    process on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def peak_reserved_bytes(device: torch.device) -> int | None:
    """A GPU's caching allocator's peak of reserved memory since `reset_peak_memory`, the tensors'
    blocks and what it held beyond them (`autopart.predict.headroom`); None on the CPU."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def peak_memory_per_rank(device: torch.device, reporting: bool) -> dict[str, list[int]]:
    """Every rank's peak so far (`peak_memory_bytes`), and on a GPU its allocator's reserved peak
    (`peak_reserved_bytes`), as train.py's --metrics names them: every rank takes
    part in one gather into one (world, k) tensor, which the reporter alone reads, once (the
    others get empty lists). gloo gathers into the tensor's rows, in the list form: the tensor
    form (``_allgather_base``) is missing from the gloo of earlier torch releases."""
    reserved = peak_reserved_bytes(device)
    mine = tensor([peak_memory_bytes(device)] + ([] if reserved is None else [reserved]), device, torch.int64)
    gathered = torch.zeros((dist.get_world_size(), mine.numel()), dtype=torch.int64, device=device)
    if device.type == "cuda":
        dist.all_gather_into_tensor(gathered, mine)
    else:
        dist.all_gather(list(gathered.unbind()), mine)
    if not reporting:
        return {"peak_memory_bytes": []}
    ranks = gathered.tolist()
    peaks = {"peak_memory_bytes": [r[0] for r in ranks]}
    return peaks if reserved is None else {**peaks, "peak_reserved_bytes": [r[1] for r in ranks]}


Mark = float | torch.cuda.Event
"""An instant of a step: a clock reading on the CPU, a recorded CUDA event on a GPU."""


class StepTimer:
    """Marks within one step, as ``time.perf_counter`` seconds once the step is over.

    On the CPU a mark is the clock's reading. On a GPU it is a CUDA event recorded in the
    current stream, which costs the host nothing; `seconds` turns it into the same clock's
    seconds after the step by its distance from the event recorded at the start.
    """

    def __init__(self, device: torch.device, *, settle: bool = True) -> None:
        """``settle``: wait first for what the device still runs. Needed where this step's marks
        are read (`seconds` counts them from the start, as if the device were idle there), or where
        work that is not this step's was launched since the previous step's `stop` (a held-out
        evaluation, a checkpoint); past a step's `stop` and its few reductions the wait only stops
        the host from launching this step's first kernels while the device ends them."""
        self.cuda = device.type == "cuda"
        self.device = device
        if settle:
            synchronize(device)
        self.start = time.perf_counter()
        self._origin = self.mark()

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self) -> float:
        """Wait for the device; the step's end in ``time.perf_counter`` seconds."""
        synchronize(self.device)
        return time.perf_counter()

    def seconds(self, mark: Mark) -> float:
        """A mark in ``time.perf_counter`` seconds; on a GPU, only after `stop`."""
        if isinstance(mark, float):
            return mark
        assert isinstance(self._origin, torch.cuda.Event)
        return self.start + self._origin.elapsed_time(mark) / 1e3
