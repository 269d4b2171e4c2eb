"""The training data of a step: the i-th global batch, split into microbatches.

Every rank draws the same global batches (from the model file's ``batches(B, seed)``, or seeded
synthetic batches shaped like ``example_batch``) and keeps the microbatches and the graph inputs
that it needs. Nothing about the data travels between ranks.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from autopart.ir.model_file import ModelSpec, check_batch, describe_error
from autopart.ir.errors import ConfigError, ModelFileError
from autopart.ir.plan import Plan

__all__ = ["apart", "eval_batches", "global_batches", "model_file", "shaped_as", "split_microbatches",
           "synthetic_batches", "training_batches"]


T = TypeVar("T")


def model_file(out_dir: Path, plan: Plan) -> Path:
    """The model file to take the data functions from: the original when it is still the file
    that was compiled (its imports of sibling files keep working), else the copy in OUT (also where
    the original cannot be read here: the copy is the file that was compiled)."""
    original = Path(plan.provenance.model_file)
    try:
        if original.is_file() and hashlib.sha256(original.read_bytes()).hexdigest() == plan.provenance.model_sha256:
            return original
    except OSError:
        pass
    return out_dir / "model.py"


def synthetic_batches(spec: ModelSpec, batch_size: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """Seeded random batches with the shapes, dtypes and value ranges of ``example_batch``: floats
    from a normal distribution, integers uniform over the example's range. One negative value
    beside non-negative ones is read as a marker, not as the start of a range (cross_entropy's
    ``ignore_index=-100`` on padded labels): the range is the non-negative values', since a value
    drawn between a marker and the classes (-43) is no class at all; several negative values are
    a signed range (relative positions). The example is drawn `apart` in a state of its own: an
    ``example_batch`` that draws from torch's global generator (``torch.randint(0, 8, (b,))``)
    would otherwise give each rank and each launch another range, and the ranks' data would
    differ from each other's and from one process's."""
    inputs, target = next(apart(lambda: [spec.example(batch_size)], 0))
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
            if like.numel() == 0:
                return like.clone()
            negative = like[like < 0].unique()
            kept = like[like >= 0] if negative.numel() == 1 and bool((like >= 0).any()) else like
            low, high = int(kept.min()), int(kept.max())
            return torch.randint(low, high + 1, like.shape, generator=generator, dtype=like.dtype)

        yield tuple(fill(x) for x in inputs), fill(target)
        step += 1


def global_batches(spec: ModelSpec, batch_size: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """The training batches: the model file's ``batches(B, seed)`` (each drawn `apart` from
    training's random state), else synthetic ones."""
    if spec.batches is None:
        yield from synthetic_batches(spec, batch_size, seed)
        return
    example = next(apart(lambda: [spec.example(batch_size)], 0))
    for batch in _users(spec, "batches", apart(lambda: spec.batches(batch_size, seed), seed), (batch_size, seed)):
        yield shaped_as(example, spec, "batches", check_batch(spec.path, "batches", batch, batch_size))


def shaped_as(example: tuple[tuple[torch.Tensor, ...], Any], spec: ModelSpec, producer: str,
              batch: tuple[tuple[torch.Tensor, ...], Any]) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``batch``, once its tensors are known to be shaped as ``example``'s (``example_batch``'s)
    past the batch dimension, and of its dtypes: the plan was compiled for those shapes, and a stage given others
    failed far from the cause (its output not the message the next stage awaits, put down to
    autocast)."""
    inputs, target = batch
    if len(inputs) != len(example[0]):
        raise ModelFileError(f"{producer}() in {spec.path.name} gives {len(inputs)} inputs, where example_batch gives "
                             f"{len(example[0])}, the inputs the plan was compiled for; give as many")
    for i, (tensor, like) in enumerate(zip([*inputs, target], [*example[0], example[1]])):
        if isinstance(tensor, torch.Tensor) and isinstance(like, torch.Tensor) and tensor.shape[1:] != like.shape[1:]:
            what = f"input {i}" if i < len(inputs) else "the target"
            raise ModelFileError(
                f"{producer}() in {spec.path.name}: {what} has shape {tuple(tensor.shape)}, where example_batch's is "
                f"{(tensor.shape[0], *like.shape[1:])}, the shape the plan was compiled for; give batches of "
                "example_batch's shapes, or make example_batch give these and compile again"
            )
        if isinstance(tensor, torch.Tensor) and isinstance(like, torch.Tensor) and tensor.dtype != like.dtype:
            what = f"input {i}" if i < len(inputs) else "the target"
            raise ModelFileError(
                f"{producer}() in {spec.path.name}: {what} is {str(tensor.dtype).removeprefix('torch.')}, where "
                f"example_batch's is {str(like.dtype).removeprefix('torch.')}, the dtype the plan was compiled for; "
                f"give batches of example_batch's dtypes (.to({like.dtype})), or make example_batch give these and "
                "compile again"
            )
    return batch


def training_batches(spec: ModelSpec, batch_size: int, seed: int, *,
                     epochs: bool = False) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """`global_batches` for a run of a given number of steps, which the model file's batches must
    not run out before: every rank draws the same batches, so every rank stops at the same step,
    with one line, before it waits for a peer. ``epochs``: where they run out, they are drawn again,
    one epoch after another, for a run that times steps (``train.py --seconds``): the compile's runs
    of a plan here take as many steps as fit their seconds, which a model file of a small dataset
    failed, so that its pipeline and finalists were never measured."""
    drawn = 0
    while True:
        before = drawn
        for batch in global_batches(spec, batch_size, seed):
            drawn += 1
            yield batch
        if not epochs or drawn == before:
            break
    raise ConfigError(f"batches({batch_size}, {seed}) of {spec.path.name} ran out after {drawn} global batches, "
                      "before the last step (a resumed run draws the batches of the steps done too); make it yield "
                      "as many as --steps (one epoch after another), or lower --steps")


def _users(spec: ModelSpec, producer: str, items: Iterator[T], arguments: tuple[int, int]) -> Iterator[T]:
    """``items`` drawn from the model file's ``producer``, whose errors (the user's code may raise
    anything: a wrong signature, a file it cannot open) are one line naming the model file's line."""
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except Exception as exc:
            raise ModelFileError(f"{producer}{arguments} in {spec.path.name} raised {describe_error(exc, spec.path)}; "
                                 f"fix {producer}()") from None
        yield item


def apart(make: Callable[[], Iterable[T]], seed: int) -> Iterator[T]:
    """The items of the iterable that ``make()`` returns, made and each drawn with torch's CPU
    generator, this process's CUDA device's (once it uses one) and Python's ``random`` in
    states of the data's own: seeded ``seed`` before the call, then as the previous draw left them.

    A model file's ``batches`` that draws from the global generators (``torch.randint`` without
    a ``generator``, on the CPU or with ``device="cuda"``, ``random.shuffle``, a shuffling
    ``DataLoader``, which draws its seed when it is iterated) would otherwise draw from what
    training left there: each forward seeds torch's per stage (dropout), so pipeline ranks would
    draw different batches (the last stage's targets no longer the first stage's inputs'), and a
    resume restores each rank's state and replays the steps done, so batches after it would
    differ from those of one uninterrupted run. Training's own states are put back after every
    draw."""
    cpu, python = torch.Generator().manual_seed(seed).get_state(), random.Random(seed).getstate()
    cuda: dict[int, torch.Tensor] = {}  # per device, from the first draw after the process starts using it
    source: Iterator[T] | None = None
    while True:
        # a process that has not started CUDA (a compile, a CPU run) draws nothing there worth a context
        devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        for device in devices:
            cuda.setdefault(device, torch.Generator(device=f"cuda:{device}").manual_seed(seed).get_state())
        training = random.getstate()
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu)
            for device in devices:
                torch.cuda.set_rng_state(cuda[device], device)
            random.setstate(python)
            try:
                source = iter(make()) if source is None else source
                item = next(source)
            except StopIteration:
                return
            finally:
                cpu, python = torch.get_rng_state(), random.getstate()
                cuda.update({device: torch.cuda.get_rng_state(device) for device in devices})
                random.setstate(training)
        yield item


class HeldOut:
    """The ``count`` held-out batches of every evaluation, drawn afresh each time they are
    iterated, the same batches each time (so that evaluations compare): the model file's
    ``eval_batches(B, seed)``, else synthetic batches of seed ``-1 - seed``, a seed that no
    training run (seeds from 0) draws. None is kept between evaluations: ``--eval-batches`` may
    be larger than memory holds."""

    def __init__(self, spec: ModelSpec, batch_size: int, seed: int, count: int):
        self.spec, self.batch_size, self.seed, self.count = spec, batch_size, seed, count
        # a model file that gives too few is told before training (synthetic batches never run out)
        drawn = count if spec.eval_batches is None else sum(1 for _ in self._source())
        if drawn < count:
            raise ConfigError(f"eval_batches() of {spec.path.name} gave {drawn} batches but --eval-batches is "
                              f"{count}; give more or lower --eval-batches")

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
        return self._source()

    def _source(self) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
        spec, batch_size, seed = self.spec, self.batch_size, self.seed
        if spec.eval_batches is None:
            source = synthetic_batches(spec, batch_size, -1 - seed)
        else:
            example = next(apart(lambda: [spec.example(batch_size)], 0))
            drawn = _users(spec, "eval_batches", apart(lambda: spec.eval_batches(batch_size, seed), -1 - seed),
                           (batch_size, seed))
            source = (shaped_as(example, spec, "eval_batches", check_batch(spec.path, "eval_batches", b, batch_size))
                      for b in drawn)
        return (batch for _, batch in zip(range(self.count), source))


def eval_batches(spec: ModelSpec, batch_size: int, seed: int, count: int) -> HeldOut:
    """The held-out batches of every evaluation (`HeldOut`)."""
    return HeldOut(spec, batch_size, seed, count)


def split_microbatches(values: tuple[Any, ...], microbatches: int) -> list[tuple[Any, ...]]:
    """Split every tensor along the batch dimension into ``microbatches`` equal parts."""
    parts = [v.chunk(microbatches, dim=0) if isinstance(v, torch.Tensor) else [v] * microbatches for v in values]
    return [tuple(p[m] for p in parts) for m in range(microbatches)]
