"""A checker, installed in each rank by the tests, that fails when a collective or a message
carries a tensor that is not on its process group's compute device.

NCCL moves only CUDA tensors: a tensor made on the host (``torch.tensor([x])`` without a device)
and all-reduced over an NCCL group raises on a GPU. On a CPU machine every tensor is a CPU
tensor and gloo takes them all, so the device alone cannot tell. The checker therefore also
plays the GPU's part for the host: a `TorchFunctionMode` marks every tensor that would live on
the host on a GPU machine (made by a factory without ``device=``, or by ``.cpu()``), and what is
computed from host tensors only; ``.to(device)`` and ``.cuda()`` move a tensor to the compute
device, clearing the mark. A marked tensor handed to ``torch.distributed`` fails the rank with
one line that names the call.

Installed by ``tests/rank_zygote.py`` when a rank's environment has ``AUTOPART_DEVICE_CHECK=FILE``;
at ``destroy_process_group`` the rank appends to FILE how many tensors each call checked, so a
test can see that the check ran.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["install", "CHECKED_CALLS"]

CHECKED_CALLS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
    "all_gather_single", "reduce_scatter_single",  # newer torch's names (2.13), where the torch at hand has them
)  # fmt: skip
_FACTORIES = {
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "linspace",
    "eye", "scalar_tensor", "empty_strided", "randperm",
}  # fmt: skip
_MARK = "_made_on_host"


def _host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _MARK, False)


def _set(values: Any, host: bool) -> None:
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor):
            try:
                setattr(value, _MARK, host)
            except (AttributeError, RuntimeError):  # a tensor type that takes no attributes
                pass


class _HostTensors(TorchFunctionMode):
    """Marks the tensors that a GPU machine would hold on the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _FACTORIES:
            _set(result, kwargs.get("device") is None)
        elif name == "cpu":
            _set(result, True)
        elif name == "cuda" or (name == "to" and _moves(args, kwargs)):
            _set(result, False)
        elif (name.endswith("_") and not name.startswith("__")) or name == "__setitem__":
            pass  # in place: the tensor stays where it is
        else:
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if any(_host(t) and t.dim() > 0 for t in inputs) or (inputs and all(_host(t) for t in inputs)):
                _set(result, True)
        return result


def _moves(args: tuple, kwargs: dict) -> bool:
    """``tensor.to(...)`` names a device (the compute device, in a test on the CPU)."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (torch.device, str, int))


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a group's collectives run on: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checked(name: str, call, counts: Counter):
    @functools.wraps(call)
    def check(*args, **kwargs):
        group = kwargs.get("group")
        expected = _group_device(group)
        for value in tree_flatten((args, kwargs))[0]:
            if not isinstance(value, torch.Tensor):
                continue
            if value.device != expected or _host(value):
                where = "made on the host" if _host(value) else f"on {value.device}"
                raise RuntimeError(
                    f"device check: dist.{name} got a {tuple(value.shape)} {value.dtype} tensor {where}, "
                    f"but its group computes on {expected if expected.type == 'cuda' else 'the compute device'}"
                )
            counts[name] += 1
        return call(*args, **kwargs)

    return check


def install(report: Path) -> None:
    """Wrap the torch.distributed calls that the runtime makes, and start marking host tensors."""
    counts: Counter = Counter()
    for name in CHECKED_CALLS:
        if hasattr(dist, name):
            setattr(dist, name, _checked(name, getattr(dist, name), counts))
    destroy = dist.destroy_process_group

    def destroy_and_report(*args, **kwargs):
        with open(report, "a") as file:
            file.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "checked": dict(counts)}) + "\n")
        return destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_and_report
    if not torch.cuda.is_available():  # on a GPU the devices themselves tell
        _HostTensors().__enter__()
