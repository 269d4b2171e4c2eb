"""The gradients of a step after the pipeline: tied copies summed, data-parallel replicas
averaged, and the whole model's gradient clipped to a norm, each rank holding its share.

The order is the mathematics': a tied parameter's copies are summed first (its gradient is the
sum over its uses), then replicas averaged (the mean loss over the global batch), and only then
is the norm taken, of gradients that equal the single-process model's.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

from autopart.ir.plan import Plan
from autopart.runtime.device import compute_device
from autopart.runtime.fully_sharded import FSDP_LEVELS, local
from autopart.runtime.mesh import Coordinates, Mesh

__all__ = ["tied_groups", "sum_tied_gradients", "average_gradients", "clip_gradients"]


def tied_groups(plan: Plan, mesh: Mesh, rank: int, timeout: datetime.timedelta | None = None
                ) -> list[tuple[str, dist.ProcessGroup]]:
    """One group per tied parameter and (dp, tp) slice: the pipeline ranks that hold a copy.
    Every rank creates every group, in the same order, as torch.distributed requires.
    ``timeout``: the job's (a group made without one waits torch's default half hour)."""
    mine = []
    for name, holders in sorted(plan.tied_parameters.items()):
        pipeline_ranks = sorted({plan.stages[s].rank for s in holders})
        for dp in range(mesh.dp):
            for tp in range(mesh.tp):
                ranks = [mesh.rank(dp=dp, pp=p, tp=tp) for p in pipeline_ranks]
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine.append((name, group))
    return mine


def average_gradients(parameters: list[torch.nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Mean of the gradients over the data-parallel group, in buckets of about 25 MB."""
    bucket: list[torch.Tensor] = []
    filled = 0
    grads = [p.grad for p in parameters if p.grad is not None]
    for i, grad in enumerate(grads):
        bucket.append(grad)
        filled += grad.numel() * grad.element_size()
        if filled >= _BUCKET_BYTES or i == len(grads) - 1:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat /= size
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, filled = [], 0


_BUCKET_BYTES = 25 * 1024 * 1024


def sum_tied_gradients(stages: dict[int, nn.Module], name: str, group: dist.ProcessGroup) -> None:
    """Every copy of a parameter held by several stages gets the sum of all copies' gradients."""
    copies = [p for module in stages.values() for n, p in module.named_parameters() if n == name]
    if not copies[0].requires_grad:  # frozen in the model: every rank leaves it, and none waits here
        return
    total = torch.zeros_like(local(copies[0]))  # under FSDP every copy holds the same shard of it
    for copy in copies:
        if copy.grad is not None:
            total += local(copy.grad)
    dist.all_reduce(total, group=group)
    for copy in copies:
        if copy.grad is None:
            copy.grad = torch.zeros_like(copy)
        local(copy.grad).copy_(total)


def clip_gradients(stages: dict[int, nn.Module], plan: Plan, here: Coordinates, max_norm: float) -> torch.Tensor:
    """Scale every gradient so that the whole model's gradient norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` on the single-process model; return the norm before, a
    one-element fp64 tensor on the device, read only where it is reported (after the step's sync).

    Each parameter's square sum is counted once over the world: by the data-parallel replica 0
    alone (after averaging, every replica holds the same gradients), or under ZeRO-2/3 by every
    replica for the shard it holds; a tensor-parallel shard by
    each of its ranks (the shards partition it), a replicated parameter by tensor-parallel rank 0
    alone; a tied parameter by the first stage that holds it (after the sum, every copy holds the
    whole gradient). One all-reduce of one number, then every rank scales by the same factor,
    computed on the device as torch computes it: a factor read on the host would stop the host
    between the backward and the optimizer step until the device caught up.
    """
    device = next((p.device for module in stages.values() for p in module.parameters()), compute_device())
    counted = []
    if here.dp == 0 or plan.zero in FSDP_LEVELS:
        for s, module in stages.items():
            placements = plan.stages[s].parameter_placements
            for name, parameter in module.named_parameters():
                holders = plan.tied_parameters.get(name)
                sharded = placements.get(name, "R").startswith("S")
                if parameter.grad is None or (holders and holders[0] != s) or (here.tp != 0 and not sharded):
                    continue
                counted.append(local(parameter.grad).detach())
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    for (_, dtype), grads in _by_device_and_dtype(counted).items():
        squares += _norms(grads, dtype).to(device, torch.float64).square().sum()
    dist.all_reduce(squares)
    norm = squares.sqrt()
    ratio = torch.full_like(norm, max_norm).div_(norm + 1e-6)  # max_norm / norm rounds twice (a reciprocal)
    factor = torch.where(ratio < 1.0, ratio, 1.0)  # a Python min(1, ratio): 1 where the norm is NaN too
    grads = [local(p.grad) for module in stages.values() for p in module.parameters() if p.grad is not None]
    for (_, dtype), group in _by_device_and_dtype(grads).items():
        _scale(group, factor.to(group[0].device), dtype)
    return norm


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The tensors by device and dtype, in their order: a foreach op takes tensors of one of each."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _norms(gradients: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The gradients' 2-norms, at least in fp32, as ``clip_grad_norm_`` takes them per tensor: without
    the fp64 copy of the whole tensor that a norm in fp64 would make on the device (for a
    vocabulary-sized gradient, gigabytes); the squares are summed over tensors in fp64."""
    half = dtype in (torch.bfloat16, torch.float16)
    return torch.stack(torch._foreach_norm(gradients, 2, dtype=torch.float32 if half else None))


def _scale(gradients: list[torch.Tensor], factor: torch.Tensor, dtype: torch.dtype) -> None:
    """Every gradient (of ``dtype``) times the one-element fp64 ``factor``, with the arithmetic a
    Python number's product has: the factor rounded to fp32 or kept in fp64, as the gradients'
    dtype computes. A half gradient times a 0-d factor of another dtype would round the factor to
    the gradient's dtype on a GPU; times a one-element fp32 factor of its own (a dimension of 1,
    which type promotion counts), it is computed in fp32 and rounded once, as a Python number's
    product is."""
    if dtype not in (torch.bfloat16, torch.float16):
        torch._foreach_mul_(gradients, factor.to(dtype).reshape(()))
        return
    single = factor.to(torch.float32)
    torch._foreach_mul_([g.unsqueeze(0) for g in gradients], [single] * len(gradients))
