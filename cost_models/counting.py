"""What kernels a piece of PyTorch code runs, counted at the aten level.

Counting below autograd and below every torch-level composite (``F.linear``, ``matmul``,
``scaled_dot_product_attention``, ``rms_norm``, ``cross_entropy``) means that any function a
model calls is covered, forward and backward alike, without a formula per torch function:
whatever it decomposes into is what runs, and that is what is counted.

``torch.utils.flop_counter.FlopCounterMode`` answers a narrower question (matmul, convolution
and attention FLOPs only, and not the CPU flash-attention kernels); a cost model also needs the
memory traffic of the other kernels, which is where the rest of a step's time goes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cost_models.formulas import METADATA_OPS, VIEW_OPS, fallback_rule, rule_for
from cost_models._ops import CATEGORIES, OpCall, Rule, io_bytes

__all__ = ["Kernel", "KernelRecorder", "CATEGORIES"]


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """One aten op as the cost model sees it: how much arithmetic, how much memory traffic."""

    op: str
    """The aten overload, e.g. ``"aten.mm.default"``."""
    category: str
    """One of `CATEGORIES`; the roofline charges "matmul" and "attention" at tensor-core rates."""
    flops: float
    """Floating-point operations, a multiply-add counting 2 (conventions in
    `cost_models._matmul_formulas` and `cost_models.formulas`)."""
    bytes: float
    """Bytes read plus bytes written; 0 for views and other metadata-only ops."""
    dtype: str
    """The dtype the kernel computes in, e.g. ``"float32"``, ``"bfloat16"``."""

    def __post_init__(self) -> None:
        assert self.category in CATEGORIES, self.category


class KernelRecorder(TorchDispatchMode):
    """Records every aten op run inside it as a `Kernel`, in order, into ``self.kernels``.

    Works on real tensors and on meta or fake tensors (``FakeTensorMode``), where counts come
    from shapes alone, so that a model too large for this machine can still be costed::

        with FakeTensorMode(), KernelRecorder() as recorder:
            loss = model(x).sum(); loss.backward()
        recorder.kernels  # list[Kernel]

    An op with no formula of its own is split into the ops it is made of when it has such a
    decomposition, and otherwise counted as an elementwise op over its output: the recorder
    never fails because an op is new to it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[Kernel] = []
        self._warned: set[str] = set()  # ops whose formula failed, each reported once

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in METADATA_OPS:
            return func(*args, **kwargs)
        if rule_for(name, func.tags) is None:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        kernel = self._kernel(func, name, args, kwargs, out)
        if kernel is not None:
            self.kernels.append(kernel)
        return out

    def _kernel(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> Kernel | None:
        inputs = _unique(_tensors((args, kwargs)))
        outputs = _unique(_tensors(out))
        if not inputs and not outputs:
            return None  # no tensor touched: bookkeeping, not a kernel
        dtype = _dtype_name(inputs, outputs)
        if _is_view(func, name):
            return Kernel(op=str(func), category="view", flops=0.0, bytes=0.0, dtype=dtype)
        call = OpCall(name=name, args=_bind(func, args, kwargs), inputs=inputs, outputs=outputs)
        rule = rule_for(name, func.tags) or fallback_rule()
        try:
            flops, byte_count = _apply(rule, call)
        except Exception as error:  # a formula meeting arguments it did not foresee
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"cost_models: cannot count {func} ({error!r}); counting it as "
                              "elementwise over its output", stacklevel=2)
            rule = fallback_rule()
            flops, byte_count = _apply(rule, call)
        return Kernel(op=str(func), category=rule.category, flops=flops, bytes=byte_count,
                      dtype=dtype)


def _op_name(func: Any) -> str:
    """``"mm"`` for ``aten.mm.default``: the name formulas are keyed by."""
    return func._schema.name.partition("::")[2]


def _is_view(func: Any, name: str) -> bool:
    """A view aliases its input without writing: read from the schema, so new view ops count."""
    if name in VIEW_OPS or torch.Tag.inplace_view in func.tags:
        return True
    returns = func._schema.returns
    return bool(returns) and all(
        ret.alias_info is not None and not ret.alias_info.is_write for ret in returns)


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _unique(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    seen: set[int] = set()
    unique = []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append(tensor)
    return tuple(unique)


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [argument.name for argument in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _dtype_name(inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> str:
    """The first floating dtype among outputs then inputs: the dtype the arithmetic runs in."""
    for tensor in (*outputs, *inputs):
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return str((outputs or inputs)[0].dtype).removeprefix("torch.")


def _apply(rule: Rule, call: OpCall) -> tuple[float, float]:
    byte_count = rule.bytes(call) if rule.bytes is not None else io_bytes(call)
    return float(rule.flops(call)), float(byte_count)
