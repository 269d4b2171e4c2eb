"""Activations forward and gradients backward between pipeline stages.

Ordered ``isend``/``irecv`` pairs, one tensor at a time: every pair of ranks sends and receives
in the same order, so messages match without tags. (gloo's ``batch_isend_irecv`` is no real
batch and is known to hang.) Sends are asynchronous and waited for at the end of the step;
receives are waited for before the action that consumes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.annotate import TensorMeta

__all__ = ["send_tensors", "recv_tensors"]


def send_tensors(tensors: list[torch.Tensor], peer: int) -> list[dist.Work]:
    return [dist.isend(t.detach().contiguous(), peer) for t in tensors]


def recv_tensors(metas: list[TensorMeta], peer: int, device: torch.device) -> list[torch.Tensor]:
    buffers = [torch.empty(m.shape, dtype=getattr(torch, m.dtype), device=device) for m in metas]
    works = [dist.irecv(buffer, peer) for buffer in buffers]
    for work in works:
        work.wait()
    return buffers
