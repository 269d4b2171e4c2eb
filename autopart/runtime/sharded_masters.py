"""ZeRO-1 under ``--dtype bf16``: Megatron-LM's distributed optimizer (``--use-distributed-optimizer``).

Every data-parallel replica holds the stage's weights as bf16 only, and its fp32 gradients
whole; the fp32 master weights and the optimizer's state exist only for the parameters that the
replica owns: 2 + 4 + 12/dp bytes per parameter with AdamW (`autopart.predict.memory.state_bytes`).

The parameters stay the module's ``nn.Parameter`` objects, so that everything that works on their
gradients (the bucketed all-reduce, tied sums, clipping, the split backward's W) runs unchanged:
their ``.grad`` is the whole fp32 gradient (Megatron's ``main_grad``). A parameter that this
replica does not own has its fp32 data released: it becomes one NaN expanded to its shape (no
storage), so that anything still reading it fails loudly rather than training on stale weights.
Its bf16 weight lives beside it (`working_weight`), a view into one flat bf16 buffer per owner.
The forward's working copy of a parameter is that bf16 weight, made differentiable back to the
parameter by a cast whose backward is autograd's own for ``.to(bfloat16)``: each microbatch's
bf16 weight gradient is cast to fp32 and accumulated into ``.grad``, the same arithmetic in the
same order as the cast from fp32 masters (`autopart.runtime.forward`), so losses match the run
without ZeRO bit for bit.

Whole parameters are partitioned over the replicas, largest first onto the least-loaded replica
(`autopart.ir.owners`, torch's ``ZeroRedundancyOptimizer``'s rule, over all the groups at once),
rather than flat shards: each owner then steps
whole tensors with the optimizer of `autopart.runtime.optim`, one tensor at a time exactly as
the unsharded run does, its state keeps the parameters' shapes (checkpoints and ``consolidate``
read it as before), and the weight decay of every parameter group applies per parameter as
ever. After the step each owner casts its updated masters into its bf16 buffer and broadcasts it
over the data-parallel group: bf16 bytes, half the fp32 all-gather of ``ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopart.ir.owners import partition

__all__ = ["ShardedMasters", "holds_master", "working_weight"]

_WEIGHT = "autopart_bf16_weight"  # the attribute of a parameter that holds its bf16 weight
_RELEASED = "autopart_released"  # the attribute that marks a parameter whose fp32 master is elsewhere


def working_weight(parameter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``parameter`` in ``dtype`` for a forward, differentiable back to it while grad is on:
    its held bf16 weight under `ShardedMasters`, else a cast of the fp32 parameter."""
    held = getattr(parameter, _WEIGHT, None)
    if held is None:
        return parameter.to(dtype) if parameter.is_floating_point() else parameter
    return _Working.apply(parameter, held)


def holds_master(parameter: torch.Tensor) -> bool:
    """False for a parameter whose fp32 master another data-parallel replica holds."""
    return not getattr(parameter, _RELEASED, False)


class _Working(torch.autograd.Function):
    """The held bf16 weight as the parameter's working copy; its backward is ``.to``'s backward."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        return weight.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.master_dtype), None


class ShardedMasters(torch.optim.Optimizer):
    """The optimizer of `make_optimizer` (``kind`` with ``options``) over this replica's share of
    the parameters, the bf16 weights of all of them, gathered after each step."""

    def __init__(self, groups: list[dict], kind: type, options: dict, group: dist.ProcessGroup,
                 working: torch.dtype = torch.bfloat16):
        super().__init__(groups, dict(options))
        self.group = group
        self.rank = dist.get_rank(group)
        tensors = [p for g in self.param_groups for p in g["params"]]
        owners = partition([[p.numel() for p in tensors]], dist.get_world_size(group))[0]  # one group: all of them
        self.owned = [[p for p, o in zip(tensors, owners) if o == r] for r in range(dist.get_world_size(group))]
        self.buffers = [self._hold_weights(params, working) for params in self.owned]
        mine = {id(p) for p in self.owned[self.rank]}
        inner = [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in self.param_groups]
        self.optim = kind(inner, **options)
        for p in tensors:
            if id(p) not in mine:  # another replica steps it: its fp32 master goes
                p.data = torch.full((), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)
                setattr(p, _RELEASED, True)

    @staticmethod
    def _hold_weights(params: list[torch.Tensor], working: torch.dtype) -> torch.Tensor:
        """One owner's bf16 weights, cast from the masters every replica starts with, as views of one buffer."""
        device = params[0].device if params else torch.device("cpu")
        flat = torch.empty(sum(p.numel() for p in params), dtype=working, device=device)
        offset = 0
        for p in params:
            weight = flat[offset : offset + p.numel()].view(p.shape)
            weight.copy_(p.detach())
            setattr(p, _WEIGHT, weight)
            offset += p.numel()
        return flat

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Step this replica's masters with the groups' current settings (the schedule's lr), then
        share every replica's updated weights in bf16."""
        if closure is not None:
            raise ValueError("ShardedMasters.step takes no closure")
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optim.step()
        self.gather_weights()

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Every replica's bf16 weights from their owners' masters (after a step, after a resume)."""
        for r, (flat, params) in enumerate(zip(self.buffers, self.owned)):
            if r == self.rank:
                for p in params:
                    getattr(p, _WEIGHT).copy_(p)
            if flat.numel():  # its bytes: a broadcast of uint8 needs no bf16 support from the backend
                dist.broadcast(flat.view(torch.uint8), src=dist.get_global_rank(self.group, r), group=self.group)

    @torch.no_grad()
    def gather_masters(self) -> None:
        """Every fp32 master whole on every replica again (to write the final weights): each
        owner broadcasts its own; the training state is whole from here on."""
        for r, params in enumerate(self.owned):
            for p in params:
                if r != self.rank:
                    p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                    setattr(p, _RELEASED, False)
                dist.broadcast(p.data, src=dist.get_global_rank(self.group, r), group=self.group)
