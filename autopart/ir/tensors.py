"""Tensor metadata and training precisions: the values a plan records about tensors.

The runtime reads them as the compiler wrote them, so they live here, below both.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DTYPES", "SEARCHED_DTYPES", "PRECISION_TEXT", "TensorMeta", "autocast_dtype", "working_dtype", "precision", "tensor_meta"]


DTYPES = ("fp32", "bf16", "bf16-autocast")
"""Training precisions (``Plan.dtype``). ``fp32``. ``bf16``, mixed precision as Megatron-LM's
``--bf16`` runs it: each rank holds bf16 working copies of its weights, cast once per step from
the fp32 master weights that the optimizer updates; every microbatch's bf16 weight gradients are
accumulated into fp32 gradients (Megatron's ``main_grad``), which tied and data-parallel
reductions sum in fp32. ``bf16-autocast``: fp32 weights that ``torch.autocast`` casts again in
every forward (and recompute), as a plain PyTorch loop under autocast runs. Both run the
forward under ``torch.autocast(bfloat16)``, so the ops on autocast's fp32 list (softmax, norms,
losses) still run in fp32."""

SEARCHED_DTYPES = ("fp32", "bf16")
"""The precisions that ``--dtype auto`` chooses between."""


PRECISION_TEXT = {
    "fp32": "fp32",
    "bf16": "torch.autocast(bfloat16) over bf16 working weights cast once per step from fp32 master weights; "
            "gradients accumulated in fp32",
    "bf16-autocast": "torch.autocast(bfloat16) over fp32 weights, cast in every forward; gradients fp32",
}
"""How each precision runs, in the words the report and the stage files use."""


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The dtype that ``torch.autocast`` runs the forward in, or None for plain fp32."""
    return {"fp32": None, "bf16": torch.bfloat16, "bf16-autocast": torch.bfloat16}[dtype]


def working_dtype(dtype: str) -> torch.dtype | None:
    """The dtype of the weights' working copies that forward and backward use, or None where
    they use the fp32 parameters themselves."""
    return {"fp32": None, "bf16": torch.bfloat16, "bf16-autocast": None}[dtype]


def precision(dtype: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    """The context a forward runs in at ``dtype``: autocast for either bf16, nothing for fp32."""
    lower = autocast_dtype(dtype)
    return torch.autocast(device_type, dtype=lower) if lower is not None else contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", ...
    split_dim: int | None = None
    """Where set, each rank of the tensor-parallel group holds its 1/t of the tensor along this dim
    (the shape is the whole tensor's): a sequence-parallel value that crosses a pipeline
    boundary, sent and received as each rank's slice (`autopart.ir.scatter_gather`)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_json(self) -> dict[str, Any]:
        split = {} if self.split_dim is None else {"split_dim": self.split_dim}
        return {"shape": list(self.shape), "dtype": self.dtype, **split}

    @staticmethod
    def from_json(data: dict[str, Any]) -> TensorMeta:
        split = data.get("split_dim")
        return TensorMeta(shape=tuple(int(s) for s in data["shape"]), dtype=str(data["dtype"]),
                          split_dim=None if split is None else int(split))


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))
