"""Timing every node of the training graph where it runs: in the whole forward and backward.

An op timed alone in a loop (`cost_models.profiler.time_op`) runs with its code, its weights
and its inputs hot in the caches, and writes its output into the block the allocator has just
freed. In a training step it finds none of that: between two runs of a layer norm come a
hundred other ops. On a CPU an op takes markedly longer in the whole graph than alone, the
parameter reads of the generated code (``getattr(self.h, "0").ln_1.weight``) are no op at
all, and the backward pays for every
autograd node the engine schedules and for every parameter gradient it accumulates, which no
op's own backward contains. So on the CPU the profiler runs the whole graph, as a stage's
``forward`` and ``torch.autograd.backward`` run it, and times each node in place:

- forward: the graph's own generated code with a tick after every node; a node's time is from
  the end of the tick before it to the start of the tick after it;
- backward: a pre-hook on every autograd node marks when the engine starts it; the time until
  the next mark (or the end) belongs to the fx node that created it (found by autograd's
  sequence numbers, which grow in the order nodes are created). A parameter's gradient
  accumulation belongs to the node that reads it, and so does the forward's read of the
  parameter: a stage pays both exactly when it holds that node.

The ticks and hooks cost time of their own, and some of a run falls to no node (the engine's
scheduling between nodes, the calls' own start), so the nodes' times do not add up to a plain
run. So the graph is also run plain, alternately with the
instrumented run, and each direction's node times are scaled so that they add up to the plain
forward or backward: a stage is charged its share of the whole.

What this leaves out, a stage's runtime adds: starting the backward (``autograd_call_s``) and
calling the module (``module_call_s``).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopart.passes.buffer_writes import check_buffers_hold_no_graph
from autopart.profiling.span import span

__all__ = ["MIN_SECONDS", "SHARES_SECONDS", "NodeTimes", "left_as_it_was", "time_in_situ", "measure_resume", "optimizer_in_situ", "trimmed_mean"]

REPEATS = 10
"""Runs of the whole graph timed at least (after two warm-up runs)."""
MIN_SECONDS = 5.0
"""Seconds the timed runs span at least. On a shared virtual machine a core's speed can flip
between states for seconds at a time (other tenants of the host), and a training step sees
their mean, while back-to-back runs of a fraction of a second catch one state. So the runs span
seconds (a state can still outlast them), and each node keeps its trimmed mean (`trimmed_mean`):
a median would pick one of the states."""
SHARES_SECONDS = 1.5
"""Seconds the timed runs span where a run of the plan's pipeline follows
(`autopart.profiling.pipeline`): that run sets each stage's level of time, and the profile
gives only each op's share of its stage. A core's states scale every op alike, so the shares
settle in far fewer runs than the level (docs/first_run.md has the figures). A later compile of
the same model that reads the profile without running its pipeline (a search) takes its level
as it is: between profiles of this model it moved about as much at 1.5 s as at 5 s."""
OPTIMIZER_SECONDS = 1.0
"""Seconds the optimizer's timed steps span at least (one step takes a fraction of a forward)."""


@dataclass(frozen=True, kw_only=True)
class NodeTimes:
    forward_s: float = 0.0
    backward_s: float = 0.0


class _Ticks:
    """Called after every node of the instrumented graph: closes the node's forward interval and
    records the newest autograd sequence number among its outputs."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.last: float | None = None
        self.forward_s: dict[str, float] = {}
        self.sequence: list[int] = []  # growing: the newest autograd node after each node ...
        self.creators: list[str] = []  # ... and that node's name

    def tick(self, name: str, value: Any) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.forward_s[name] = now - self.last
        newest = -1
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                newest = max(newest, leaf.grad_fn._sequence_nr())
        if newest >= 0 and (not self.sequence or newest > self.sequence[-1]):
            self.sequence.append(newest)
            self.creators.append(name)
        self.last = time.perf_counter()

    def creator(self, node: torch.autograd.graph.Node) -> str | None:
        """The fx node whose run created the autograd ``node``."""
        at = bisect.bisect_left(self.sequence, node._sequence_nr())
        return self.creators[at] if at < len(self.creators) else None


def _instrumented(module: fx.GraphModule) -> tuple[fx.GraphModule, _Ticks]:
    ticks = _Ticks()

    def autopart_tick(name: str, value: Any) -> None:
        ticks.tick(name, value)

    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in module.graph.nodes:
        copies[node] = graph.node_copy(node, lambda n: copies[n])
        if node.op != "output":
            graph.create_node("call_function", autopart_tick, (node.name, copies[node]))
    return fx.GraphModule(module, graph), ticks


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.grad_fn is not None


def _backward(value: Any) -> None:
    """The backward of the graph's output: the loss, or (for a graph that ends elsewhere) its
    output with a gradient of ones."""
    if _differentiable(value):
        value.backward(torch.ones_like(value))


def _autograd_nodes(root: torch.autograd.graph.Node) -> list[torch.autograd.graph.Node]:
    seen: set = set()
    order = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return order


def _owners(nodes: list[torch.autograd.graph.Node], ticks: _Ticks) -> dict[Any, str | None]:
    """The fx node each autograd node's time belongs to; accumulators to their parameter's reader."""
    owner: dict[Any, str | None] = {}
    for node in nodes:
        if type(node).__name__ != "AccumulateGrad":
            owner[node] = ticks.creator(node)
    for node in nodes:
        for child, _ in node.next_functions:
            if child is not None and type(child).__name__ == "AccumulateGrad" and child not in owner:
                owner[child] = owner.get(node)
    return owner


@contextlib.contextmanager
def left_as_it_was(module: nn.Module) -> Iterator[None]:
    """Runs of ``module`` inside leave its parameters without gradients and its buffers and the
    random state as they were before."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        for parameter in module.parameters():
            parameter.grad = None
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(rng)


def trimmed_mean(samples: list[float]) -> float:
    """The mean of the middle of the samples (a tenth cut from each end): the speed states in
    their proportions, without the outliers."""
    ordered = sorted(samples)
    cut = len(ordered) // 10
    kept = ordered[cut:len(ordered) - cut]
    return sum(kept) / len(kept)


def time_in_situ(module: fx.GraphModule, args: Sequence[Any], *, repeats: int = REPEATS,
                 min_seconds: float | None = None,
                 forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 ) -> dict[str, NodeTimes]:
    """Forward and backward seconds of every node of ``module`` run whole on ``args``: the trimmed
    mean over at least ``repeats`` runs spanning at least ``min_seconds`` (`MIN_SECONDS` by default,
    capped by `autopart.profiling.span`); forwards in ``forward_context()`` (the precision's autocast).

    ``get_attr`` nodes get nothing: their reads (and, in backward, their gradient accumulation)
    are charged to the first node that uses them. Leaves ``module``'s parameters without
    gradients and its buffers and the random state as they were.
    """
    timed, ticks = _instrumented(module)
    readers = {n.name: next((u.name for u in n.users if u.op != "output"), None)
               for n in module.graph.nodes if n.op == "get_attr"}
    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    plain: list[tuple[float, float]] = []  # seconds of a whole forward and backward without ticks or hooks ...
    attributed: list[tuple[float, float]] = []  # ... and what the nodes got of them with
    collecting = gc.isenabled()
    gc.disable()
    try:
        with left_as_it_was(module), torch.enable_grad():
            spanning = span(MIN_SECONDS) if min_seconds is None else min_seconds
            run, started = 0, time.perf_counter()
            while run < repeats + 2 or time.perf_counter() - started < spanning:
                run += 1
                start = time.perf_counter()
                with forward_context():
                    loss = module(*args)
                middle = time.perf_counter()
                if run == 1:
                    check_buffers_hold_no_graph(module)  # else the second backward fails in torch's words
                _backward(loss)
                plain.append((middle - start, time.perf_counter() - middle))
                ticks.reset()
                with forward_context():
                    loss = timed(*args)
                per_node = dict(ticks.forward_s)
                for attr, reader in readers.items():
                    if reader is not None:
                        per_node[reader] = per_node.get(reader, 0.0) + per_node.pop(attr, 0.0)
                spent: dict[str, float] = {}
                if _differentiable(loss):
                    nodes = _autograd_nodes(loss.grad_fn)
                    owner = _owners(nodes, ticks)
                    marks: list[tuple[float, str | None]] = []
                    # a hook holds the owner's name, not the node: a node's hook that held the node
                    # would keep it alive for ever (a cycle through C++ that gc cannot see), and with
                    # it each parameter's gradient accumulator, which every later run reuses: with a
                    # hook more per run, the runs would get slower and slower
                    handles = [node.register_prehook(lambda grads, name=owner.get(node): marks.append((time.perf_counter(), name)))
                               for node in nodes]
                    try:
                        _backward(loss)
                    finally:
                        for handle in handles:
                            handle.remove()
                    end = time.perf_counter()
                    for (start, name), stop in zip(marks, [m for m, _ in marks[1:]] + [end]):
                        if name is not None:
                            spent[name] = spent.get(name, 0.0) + stop - start
                attributed.append((sum(per_node.values()), sum(spent.values())))
                if run <= 2:
                    started = time.perf_counter()
                    continue
                for name, seconds in per_node.items():
                    forward.setdefault(name, []).append(seconds)
                for name in per_node:
                    backward.setdefault(name, []).append(spent.get(name, 0.0))
    finally:
        if collecting:
            gc.enable()
    scales = []
    for part in (0, 1):
        whole, shared = trimmed_mean([p[part] for p in plain[2:]]), trimmed_mean([a[part] for a in attributed[2:]])
        scales.append(whole / shared if shared > 0 else 1.0)
    return {name: NodeTimes(forward_s=scales[0] * trimmed_mean(forward[name]),
                            backward_s=scales[1] * trimmed_mean(backward.get(name, [0.0])))
            for name in forward}


def optimizer_in_situ(module: fx.GraphModule, args: Sequence[Any], make_step: Callable[[list[torch.Tensor]], Callable[[], Any]],
                      *, repeats: int = REPEATS, min_seconds: float | None = None) -> float:
    """Seconds of one optimizer step over (copies of) ``module``'s parameters, each step right
    after a forward and backward of the graph, as in training: the trimmed mean over at least
    ``repeats`` steps spanning ``min_seconds`` (by default `OPTIMIZER_SECONDS`, capped by
    `autopart.profiling.span`). ``make_step(parameters)`` gives the step.

    A step timed alone in a loop finds its parameters, gradients and state in the caches; after
    a training step's backward it does not, and takes markedly longer there."""
    parameters = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]  # a frozen one is not stepped
    copies = [p.detach().clone().requires_grad_(True) for p in parameters]
    for copy in copies:
        copy.grad = torch.full_like(copy, 1e-3)
    step = make_step(copies)
    step()  # the optimizer's state
    samples: list[float] = []
    spanning = span(OPTIMIZER_SECONDS) if min_seconds is None else min_seconds
    with left_as_it_was(module), torch.enable_grad():
        started = time.perf_counter()
        while len(samples) < repeats or time.perf_counter() - started < spanning:
            _backward(module(*args))
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
    return trimmed_mean(samples)


def measure_resume(module: fx.GraphModule, args: Sequence[Any], *, repeats: int = 20) -> tuple[float, float]:
    """(forward, backward): what a step's compute costs more when, before it, another process
    that runs the same model had this core (the median over ``repeats`` pairs of the difference).

    When more ranks than cores share a CPU, a rank's forward or backward starts after another
    rank has run on its core and filled the caches, the branch predictors and the TLB with its
    own state, and pays for refilling them, per action, and about as much for a whole graph as
    for a part of it. It is measured by forking a
    copy of this process that runs the graph in a loop on the same core (both pinned to it),
    and timing the graph's forward and backward (CPU time of this thread) with the copy stopped
    throughout, and again right after the copy ran for a moment (a few milliseconds).
    """
    import os
    import signal

    if not hasattr(os, "fork") or not hasattr(os, "sched_setaffinity"):
        return 0.0, 0.0
    affinity = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(affinity)})
    except OSError:  # not allowed here: no way to share one core on purpose
        return 0.0, 0.0
    module.code  # a lazily written module (autopart.passes.capture) writes its code here, not in the timed runs
    child = os.fork()
    if child == 0:  # the other rank: the same work on the same core, until killed
        try:
            with torch.enable_grad():
                while True:
                    loss = module(*args)
                    _backward(loss)
        finally:
            os._exit(0)
    warm: list[tuple[float, float]] = []
    cold: list[tuple[float, float]] = []

    def timed(let_it_run: bool) -> tuple[float, float]:
        seconds = []
        loss = None
        for part in ("forward", "backward"):
            if let_it_run:
                os.kill(child, signal.SIGCONT)
                time.sleep(0.002)
                os.kill(child, signal.SIGSTOP)
            start = time.thread_time()
            if part == "forward":
                loss = module(*args)
            else:
                _backward(loss)
            seconds.append(time.thread_time() - start)
        return seconds[0], seconds[1]

    try:
        os.kill(child, signal.SIGSTOP)
        with torch.enable_grad():
            for run in range(repeats + 1):
                w, c = timed(False), timed(True)
                if run > 0:
                    warm.append(w)
                    cold.append(c)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.sched_setaffinity(0, affinity)
        for parameter in module.parameters():
            parameter.grad = None
    return tuple(max(0.0, statistics.median(c[i] - w[i] for w, c in zip(warm, cold)))
                 for i in (0, 1))  # type: ignore[return-value]
