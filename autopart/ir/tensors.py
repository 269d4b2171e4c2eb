"""Tensor metadata and training precisions: the values a plan records about tensors.

The runtime reads them as the compiler wrote them, so they live here, below both.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DTYPES", "TensorMeta", "autocast_dtype", "precision", "tensor_meta"]


DTYPES = ("fp32", "bf16")
"""Training precisions: fp32, or bf16 autocast over fp32 weights (``Plan.dtype``)."""


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The dtype that ``torch.autocast`` runs the forward in, or None for plain fp32."""
    return {"fp32": None, "bf16": torch.bfloat16}[dtype]


def precision(dtype: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    """The context a forward runs in at ``dtype``: autocast for bf16, nothing for fp32."""
    lower = autocast_dtype(dtype)
    return torch.autocast(device_type, dtype=lower) if lower is not None else contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(data: dict[str, Any]) -> TensorMeta:
        return TensorMeta(shape=tuple(int(s) for s in data["shape"]), dtype=str(data["dtype"]))


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))
