"""The training data of a step: the i-th global batch, split into microbatches.

Every rank draws the same global batches (from the model file's ``batches(B, seed)``, or seeded
synthetic batches shaped like ``example_batch``) and keeps the microbatches and the graph inputs
that it needs. Nothing about the data travels between ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from autopart.ir.model_file import ModelSpec, check_batch
from autopart.ir.errors import ConfigError
from autopart.ir.plan import Plan

__all__ = ["eval_batches", "global_batches", "model_file", "split_microbatches", "synthetic_batches"]


def model_file(out_dir: Path, plan: Plan) -> Path:
    """The model file to take the data functions from: the original when it is still the file
    that was compiled (its imports of sibling files keep working), else the copy in OUT."""
    original = Path(plan.provenance.model_file)
    if original.is_file() and hashlib.sha256(original.read_bytes()).hexdigest() == plan.provenance.model_sha256:
        return original
    return out_dir / "model.py"


def synthetic_batches(spec: ModelSpec, batch_size: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """Seeded random batches with the shapes, dtypes and value ranges of ``example_batch``."""
    inputs, target = spec.example(batch_size)
    step = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)

        def fill(like: Any) -> Any:
            if not isinstance(like, torch.Tensor):
                return like
            if like.is_floating_point():
                return torch.randn(like.shape, generator=generator, dtype=like.dtype)
            if like.dtype == torch.bool:
                return torch.randint(0, 2, like.shape, generator=generator).bool()
            low, high = int(like.min()), int(like.max())
            return torch.randint(low, high + 1, like.shape, generator=generator, dtype=like.dtype)

        yield tuple(fill(x) for x in inputs), fill(target)
        step += 1


def global_batches(spec: ModelSpec, batch_size: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    if spec.batches is None:
        yield from synthetic_batches(spec, batch_size, seed)
        return
    for batch in spec.batches(batch_size, seed):
        yield check_batch(spec.path, "batches", batch, batch_size)


def eval_batches(spec: ModelSpec, batch_size: int, seed: int, count: int) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
    """The ``count`` held-out batches of every evaluation (the same each time, so that evaluations
    compare): the model file's ``eval_batches(B, seed)``, else synthetic batches of seed
    ``-1 - seed``, a seed that no training run (seeds from 0) draws."""
    if spec.eval_batches is None:
        source = synthetic_batches(spec, batch_size, -1 - seed)
    else:
        source = (check_batch(spec.path, "eval_batches", b, batch_size) for b in spec.eval_batches(batch_size, seed))
    batches = [batch for _, batch in zip(range(count), source)]
    if len(batches) < count:
        raise ConfigError(f"eval_batches() of {spec.path.name} gave {len(batches)} batches but --eval-batches is "
                          f"{count}; give more or lower --eval-batches")
    return batches


def split_microbatches(values: tuple[Any, ...], microbatches: int) -> list[tuple[Any, ...]]:
    """Split every tensor along the batch dimension into ``microbatches`` equal parts."""
    parts = [v.chunk(microbatches, dim=0) if isinstance(v, torch.Tensor) else [v] * microbatches for v in values]
    return [tuple(p[m] for p in parts) for m in range(microbatches)]
