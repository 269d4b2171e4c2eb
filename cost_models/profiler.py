"""Timing ops on the device at hand: warm-up, then the median of repeats.

On a GPU each call is bracketed by CUDA events (what the device did, not what the host waited
for); on the CPU by ``time.perf_counter``. The median rather than the minimum or the mean: on a
machine shared with other work the minimum is a lucky sample and the mean is pulled by bursts
of someone else's load; the median is what a run of many steps sees.

Nothing here knows about models or graphs: ``autopart.profiling.profile`` walks the graph and asks these
functions to time one node at a time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cost_models.database import OpTimes, RuntimeOverheads

__all__ = ["measure", "time_op", "measure_overheads", "fixed_and_per_item", "WARMUP", "REPEATS", "BUDGET_S"]

WARMUP = 3
"""Calls before timing starts: allocator, caches and lazily initialised kernels."""
REPEATS = 25
"""Samples per measurement at most; fewer when `BUDGET_S` runs out first (at least 5)."""
BUDGET_S = 0.03
"""Seconds of samples per measurement: bounds the time spent on one large op."""


def measure(call: Callable[[], Any], *, device: torch.device, warmup: int = WARMUP, repeats: int = REPEATS,
            budget_s: float = BUDGET_S) -> float:
    """Median seconds of one ``call()`` on ``device``."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        return _measure_cuda(call, repeats=repeats, budget_s=budget_s)
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < repeats and (len(samples) < 5 or time.perf_counter() < deadline):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _measure_cuda(call: Callable[[], Any], *, repeats: int, budget_s: float) -> float:
    torch.cuda.synchronize()
    pairs = []
    deadline = time.perf_counter() + budget_s
    while len(pairs) < repeats and (len(pairs) < 5 or time.perf_counter() < deadline):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


def _differentiable(out: Any) -> list[torch.Tensor]:
    leaves = out if isinstance(out, (list, tuple)) else [out]
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def time_op(run: Callable[[], Any], *, inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
            device: torch.device, overheads: RuntimeOverheads) -> OpTimes:
    """Forward, input-gradient and weight-gradient seconds of ``run()``.

    ``inputs`` and ``weights`` are the leaves ``run`` reads, already requiring grad. The forward
    is timed with autograd recording, as in training. Each backward half is timed as a
    ``torch.autograd.grad`` of its own, less the cost of starting one (``overheads``), which a
    stage's backward pays once for all its ops, not once per op.
    """
    try:
        forward_s = measure(run, device=device)
    except RuntimeError:  # an in-place op on a leaf: timed without autograd, as it then runs
        with torch.no_grad():
            return OpTimes(forward_s=measure(run, device=device))
    outputs = _differentiable(run())
    if not outputs:
        return OpTimes(forward_s=forward_s)
    grads = [torch.ones_like(t) for t in outputs]
    halves = []
    for wrt in (inputs, weights):
        if not wrt:
            halves.append(0.0)
            continue

        def backward(wrt: Sequence[torch.Tensor] = wrt) -> None:
            torch.autograd.grad(outputs, list(wrt), grads, retain_graph=True, allow_unused=True)

        halves.append(max(0.0, measure(backward, device=device) - overheads.autograd_call_s))
    return OpTimes(forward_s=forward_s, backward_input_s=halves[0], backward_weight_s=halves[1])


class _Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def measure_overheads(device: torch.device) -> RuntimeOverheads:
    """The fixed costs of starting a backward and of calling a module, on ``device``.

    Starting a backward is found by difference: a chain of two multiplications costs one
    start and two nodes, a single one one start and one node, so the start is
    ``2·t(one) − t(two)``.
    """
    x = torch.ones(8, device=device, requires_grad=True)
    one = x * 2
    two = (x * 2) * 2
    seed = torch.ones_like(one)
    module = _Identity()

    def plain(v: torch.Tensor) -> torch.Tensor:
        return v

    start = _difference(lambda: torch.autograd.grad(one, x, seed, retain_graph=True),
                        lambda: torch.autograd.grad(two, x, seed, retain_graph=True), scale=2, device=device)
    call = _difference(lambda: module(x), lambda: plain(x), device=device)
    return RuntimeOverheads(autograd_call_s=start, module_call_s=call)


def _difference(first: Callable[[], Any], second: Callable[[], Any], *, device: torch.device, scale: int = 1,
                repeats: int = 200, budget_s: float = 0.2) -> float:
    """``scale``·t(first) − t(second), at least 0. On the CPU each sample times the two calls
    back to back and the median is taken over the samples' differences: a machine whose speed
    moves with other work moves both halves of a sample alike, where two medians taken one after
    the other can differ by more than the few microseconds sought."""
    if device.type == "cuda":  # device time, which the host's load does not stretch
        samples = dict(repeats=repeats, budget_s=budget_s)
        return max(0.0, scale * measure(first, device=device, **samples) - measure(second, device=device, **samples))
    for _ in range(WARMUP):
        first()
        second()
    differences: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(differences) < repeats and (len(differences) < 5 or time.perf_counter() < deadline):
        flipped = len(differences) % 2  # each call first in half the samples: neither gains from the other's warmth
        start = time.perf_counter()
        (second if flipped else first)()
        middle = time.perf_counter()
        (first if flipped else second)()
        end = time.perf_counter()
        t_first, t_second = (end - middle, middle - start) if flipped else (middle - start, end - middle)
        differences.append(scale * t_first - t_second)
    return max(0.0, statistics.median(differences))


def fixed_and_per_item(make_call: Callable[[int], Callable[[], Any]], *, device: torch.device,
                       counts: Sequence[int] = (1, 2, 4, 8), rounds: int = 3) -> tuple[float, float]:
    """(fixed, per item) seconds of a call over ``n`` items, ``make_call(n)`` giving that call:
    the least-squares line through the medians at ``counts``, the sizes measured in turn for
    ``rounds`` rounds so that a burst of other load spreads over all of them. The fixed part is
    what a call costs besides its items (an optimizer ``step()`` over a rank's parameters pays
    it once, a step timed per parameter once per parameter)."""
    calls = {n: make_call(n) for n in counts}
    samples: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            samples[n].append(measure(calls[n], device=device, repeats=50, budget_s=0.05))
    xs = list(counts)
    ys = [statistics.median(samples[n]) for n in counts]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return max(0.0, mean_y - slope * mean_x), max(0.0, slope)
