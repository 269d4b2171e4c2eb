"""Plain values sent between ranks as canonical JSON bytes in tensors, never pickled.

torch's ``*_object`` collectives pickle what a rank sends and unpickle what it receives, and an
unpickled byte string can run any code. A peer of a multi-node launch is another machine, so
nothing read back from one is unpickled (as nothing read from a checkpoint is): a value goes as
``json.dumps(value, sort_keys=True)`` in a uint8 tensor, padded to the longest rank's length,
and comes back through ``json.loads``, which builds only lists, dicts, strings and numbers.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_json"]


def gather_json(value: Any, *, dst: int | None = None, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``value`` (plain JSON values: a tuple comes back a list), in rank order: on
    every rank of ``group``, or with ``dst`` on that (global) rank only, None on the others."""
    device = _group_device(group)
    data = json.dumps(value, sort_keys=True).encode()
    ranks = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(ranks)]
    dist.all_gather(lengths, length, group=group)  # every rank pads to the longest
    sizes = [int(size.item()) for size in lengths]
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if dst is None:
        everyone = [torch.empty_like(mine) for _ in range(ranks)]
        dist.all_gather(everyone, mine, group=group)
    else:
        everyone = [torch.empty_like(mine) for _ in range(ranks)] if dist.get_rank() == dst else None
        dist.gather(mine, everyone, dst=dst, group=group)
        if everyone is None:
            return None
    return [json.loads(received[:size].cpu().numpy().tobytes()) for received, size in zip(everyone, sizes)]


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s tensors live: the rank's CUDA device for NCCL (the current one, which
    `autopart.runtime.device.compute_device` made the rank's own), the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
