"""The capture's checks that its graph computes what the model computes: the same loss from the
same batch, and the same buffer writes, run after run (``autopart.passes.capture`` traces; this
module refuses what the trace got wrong, each refusal saying what in the model caused it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopart.ir.errors import CaptureError
from autopart.ir.model_file import ModelSpec, eager_loss
from autopart.passes.buffer_writes import check_writes_recorded, unrecorded_writes

__all__ = ["Example", "check_same_loss", "same_draws"]


@dataclass(frozen=True)
class Example:
    """The example batch the checks run: the model takes ``inputs`` and the loss ``target``; the
    graph takes ``graph_args`` (the target last where the graph computes the loss)."""

    inputs: tuple[torch.Tensor, ...]
    target: Any
    has_target: bool

    @property
    def graph_args(self) -> tuple[Any, ...]:
        return (*self.inputs, self.target) if self.has_target else tuple(self.inputs)


@contextlib.contextmanager
def same_draws() -> Iterator[None]:
    """The eager run and the graph's from one seed: a model that draws random numbers (dropout in
    training mode) draws the same ones in both, op for op, and the caller's generator is left as it was."""
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []  # manual_seed seeds them too
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        yield


def check_same_loss(
    spec: ModelSpec, module: fx.GraphModule, example: Example, expected: torch.Tensor | None,
    built: dict[str, torch.Tensor], versions: dict[str, int],
) -> None:
    """Refuse a captured graph that does not compute the model's loss, with the reason where it is
    known. ``built``: the model's buffers as built. Where the graph differs, those the forwards
    since changed (a running statistic) may be why: an eager run again from them tells whether they
    feed the loss (it then differs from the first). The graph must also compute the loss from the
    buffers as built, which the stages start from: a forward that fills a buffer on its first run
    only, behind a Python flag, was traced after the eager run had filled it, and the graph holds no
    fill. ``versions``: the buffers' version counters before the eager run, which tell on the meta
    device which buffers the model's forward wrote."""
    if expected is None:  # a meta model: no values to compare, annotate runs the graph on fake tensors
        check_writes_recorded(module, spec.module, versions)
        return
    traced, from_built = _check_buffer_writes(spec, module, example, built)
    with torch.no_grad(), same_draws():
        got = module(*example.graph_args)
    if torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        if not torch.allclose(from_built, expected, rtol=1e-5, atol=1e-6):
            raise _filled_once(spec, built, traced, from_built, expected)
        return
    written = tuple(name for name, b in spec.module.named_buffers() if name in built and not torch.equal(b, built[name]))
    if written:
        with torch.no_grad(), same_draws():
            again = eager_loss(spec, example.inputs, example.target)
        written = written if not torch.allclose(again, expected, rtol=1e-5, atol=1e-6) else ()
    if written:
        raise CaptureError(
            f"the captured graph computes loss {got.item():.6g} but the model computes {expected.item():.6g}: the "
            f"model's forward changes its buffer {written[0]!r}{f' (and {len(written) - 1} more)' if written[1:] else ''}"
            " and reads it back, so each run computes another loss (a running statistic that feeds the output); "
            "update it outside forward, or keep the output from reading it (as BatchNorm in training does)"
        )
    raise CaptureError(
        f"the captured graph computes loss {got.item():.6g} but the model computes {expected.item():.6g}; "
        "the model has behaviour that tracing cannot see (random numbers from outside torch's generator, "
        "global state); report this model"
    )


def _filled_once(spec: ModelSpec, built: dict[str, torch.Tensor], traced: set[str], got: torch.Tensor,
                 expected: torch.Tensor) -> CaptureError:
    filled = sorted(name for name, b in spec.module.named_buffers()
                    if name in built and name not in traced and not torch.equal(b, built[name]))
    which = f"its buffer {filled[0]!r}{f' (and {len(filled) - 1} more)' if filled[1:] else ''}" if filled else "a buffer"
    return CaptureError(
        f"from the buffers as build_model() made them the captured graph computes loss {got.item():.6g} but the "
        f"model computes {expected.item():.6g}: the model's forward fills {which} on its first run only (behind a "
        "Python flag or check, which tracing runs once and does not record), and the stages start from the buffers "
        "as built; fill it in build_model() or in the module's __init__"
    )


def _check_buffer_writes(spec: ModelSpec, module: fx.GraphModule, example: Example,
                         built: dict[str, torch.Tensor]) -> tuple[set[str], torch.Tensor]:
    """Refuse a forward that writes a buffer by an op no traced tensor reaches (a step counter's
    ``self.steps.add_(1)``): fx runs such an op once while tracing and records nothing, and
    torch.export drops it as dead code, so the stages would train with the buffer as built and
    save it so, in silence. The buffers one eager forward changes must be those the graph changes
    (a BatchNorm's running statistics are in the graph), and two forwards from the buffers as
    ``built`` must leave them as the model's do: fx computes a read that no traced value reaches
    (``0.5 * self.avg[1]``) as it traces, as a constant. Each buffer is left as it was. Returns the
    buffers the graph writes and the loss it computes from the buffers as ``built``."""
    def changed(module: nn.Module, run: Callable[[], Any]) -> tuple[set[str], list[dict[str, torch.Tensor]], Any]:
        buffers = dict(module.named_buffers(remove_duplicate=False))
        start = {name: b.clone() for name, b in buffers.items()}
        try:
            with torch.no_grad(), same_draws():
                for name in buffers.keys() & built.keys():
                    buffers[name].copy_(built[name])
                seen = [{name: b.clone() for name, b in buffers.items()}]
                losses = []
                for _ in range(2):
                    losses.append(run())
                    seen.append({name: b.clone() for name, b in buffers.items()})
            return {name for name in buffers if not torch.equal(seen[1][name], seen[0][name])}, seen[1:], losses[0]
        finally:
            with torch.no_grad():
                for name, b in buffers.items():
                    b.copy_(start[name])

    eager, eager_after, _ = changed(spec.module, lambda: eager_loss(spec, example.inputs, example.target))
    traced, traced_after, from_built = changed(module, lambda: module(*example.graph_args))
    if eager - traced:
        raise unrecorded_writes(sorted(eager - traced))
    stale = sorted({name for name in eager for ours, theirs in zip(eager_after, traced_after)
                    if not torch.allclose(ours[name].double(), theirs[name].double(), rtol=1e-5, atol=1e-6, equal_nan=True)})
    if stale:
        raise CaptureError(f"the model's forward reads its buffer {stale[0]!r}, which it changes, by an op that the "
                           "capture keeps at the value it had while tracing (a read that no input tensor reaches)")
    return traced, from_built
