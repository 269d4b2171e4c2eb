"""CUDA autocast at compile time, on a machine without a GPU.

A plan made on a laptop for an H100 must hold the dtypes the H100 will compute in: which tensors
stages send, what backward saves, which kernels run at the 16-bit rate. CPU autocast and CUDA
autocast cast different ops (CUDA runs ``pow``, ``rsqrt``, ``softmax``, ``sum`` and the losses in
fp32; CPU leaves most of them in the input's dtype), and ``torch.autocast("cuda")`` does nothing
where CUDA is absent. So the compiler applies CUDA's policy itself, at the level of torch
functions, with the op lists read from torch's own ``ATen/autocast_mode.h`` (shipped in every
wheel's ``include/``): no hand copy to fall out of date with the installed torch.

``cuda_autocast(dtype)`` is a ``TorchFunctionMode`` that casts each call's floating tensors as
CUDA autocast would (to ``dtype`` for the lower-precision list, to fp32 for the fp32 lists, to
the widest for the promote list). Autograd records the casts, so backward saves what it would
save on the GPU (the 16-bit copies of weights that matmuls keep).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autopart.ir.errors import ConfigError

__all__ = ["cuda_policies", "cuda_autocast"]

_COMPOSITES = {"cross_entropy": "fp32", "cross_entropy_loss": "fp32"}
"""Functions that autocast does not list but whose ATen parts are all on one list (cross-entropy is
``log_softmax`` then ``nll_loss``): the mode sees the outer call, not the parts."""

_LISTS = {
    "AT_FORALL_LOWER_PRECISION_FP": "lower",
    "AT_FORALL_FP32": "fp32",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",
    "AT_FORALL_PROMOTE": "promote",
}


def _header() -> Path:
    return Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


@functools.cache
def cuda_policies() -> dict[str, str]:
    """Op name (``linear``, ``softmax``) -> ``lower``, ``fp32`` or ``promote``, as the installed
    torch's CUDA autocast applies them."""
    path = _header()
    if not path.is_file():
        raise ConfigError(f"torch's {path.name} is not at {path}, so autocast on CUDA cannot be planned here; "
                          "install a torch wheel with its headers, or plan with --dtype fp32")  # fmt: skip
    text = path.read_text()
    policies: dict[str, str] = dict(_COMPOSITES)
    for macro, policy in _LISTS.items():
        body = re.search(rf"#define {macro}\(_\)((?:[^\n]*\\\n)+[^\n]*)", text)
        if body is None:
            raise ConfigError(f"{path} has no {macro} list: this torch's autocast is not one autopart knows; "
                              "plan with --dtype fp32")  # fmt: skip
        for name in re.findall(r"_\(\s*(\w+)", body.group(1)):
            policies[name.lstrip("_")] = policy
    return policies


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


class cuda_autocast(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.autocast
    """CUDA autocast's casts, applied to whatever device the tensors are on."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.policies = cuda_policies()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if isinstance(func, torch._ops.OpOverload) else getattr(func, "__name__", "")
        policy = self.policies.get(name.lstrip("_"))
        if policy == "fp32_set_opt_dtype":
            # torch's policy for these (softmax, sum, ...): a call that names its output dtype is
            # left alone; any other runs in fp32
            policy = None if kwargs.get("dtype") is not None else "fp32"
        if policy is not None:
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if _floating(t)]
            if tensors:
                target = {"lower": self.dtype, "fp32": torch.float32}.get(policy)
                if target is None:  # promote: the widest of the inputs
                    target = max((t.dtype for t in tensors), key=lambda d: torch.finfo(d).bits)
                args, kwargs = pytree.tree_map(lambda t: t.to(target) if _floating(t) else t, (args, kwargs))
        return func(*args, **kwargs)
