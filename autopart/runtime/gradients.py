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
from autopart.runtime.recipe import clip_factor

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


def clip_gradients(stages: dict[int, nn.Module], plan: Plan, here: Coordinates, max_norm: float) -> float:
    """Scale every gradient so that the whole model's gradient norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` on the single-process model; return the norm before.

    Each parameter's square sum is counted once over the world: by the data-parallel replica 0
    alone (after averaging, every replica holds the same gradients), or under ZeRO-2/3 by every
    replica for the shard it holds; a tensor-parallel shard by
    each of its ranks (the shards partition it), a replicated parameter by tensor-parallel rank 0
    alone; a tied parameter by the first stage that holds it (after the sum, every copy holds the
    whole gradient). One all-reduce of one number, then every rank scales by the same factor.
    """
    device = next((p.device for module in stages.values() for p in module.parameters()), compute_device())
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    if here.dp == 0 or plan.zero in FSDP_LEVELS:
        for s, module in stages.items():
            placements = plan.stages[s].parameter_placements
            for name, parameter in module.named_parameters():
                holders = plan.tied_parameters.get(name)
                sharded = placements.get(name, "R").startswith("S")
                if parameter.grad is None or (holders and holders[0] != s) or (here.tp != 0 and not sharded):
                    continue
                squares += _norm(local(parameter.grad).detach()).double().square()
    dist.all_reduce(squares)
    norm = float(squares.sqrt().item())
    factor = clip_factor(norm, max_norm)
    if factor < 1.0:
        for module in stages.values():
            for parameter in module.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(factor)
    return norm


def _norm(gradient: torch.Tensor) -> torch.Tensor:
    """A gradient's 2-norm, at least in fp32, as ``clip_grad_norm_`` takes it per tensor: without
    the fp64 copy of the whole tensor that a norm in fp64 would make on the device (for a
    vocabulary-sized gradient, gigabytes); the squares are summed over tensors in fp64."""
    half = gradient.dtype in (torch.bfloat16, torch.float16)
    return torch.linalg.vector_norm(gradient, dtype=torch.float32 if half else None)
