"""Timing ops where they run: per-node attribution in the whole graph, and the fixed costs the
runtime pays besides the ops (an optimizer step's own cost, resuming on a shared core)."""

import os
import time
from pathlib import Path

import pytest
import torch
from torch import fx, nn

from autopart.profiling.profile import put_in_situ
from autopart.profiling.in_situ import measure_resume, optimizer_in_situ, time_in_situ
from cost_models import CostDatabase, load_device
from cost_models.database import OpTimes
from cost_models.profiled import ProfiledCostModel, optimizer_call_key, optimizer_key
from cost_models import profiler
from cost_models.profiler import fixed_and_per_item
from cost_models.roofline import RooflineCostModel


def _spin(seconds: float) -> None:
    """``seconds`` of this thread's CPU time: as long whatever else runs here."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture()
def cpu_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timings below read this thread's CPU time, not the wall clock: a preemption by another
    process adds milliseconds of wall time to whichever node it lands in, and on a loaded machine
    in enough runs to move their mean past any bound. A CPU-only graph runs its backward on the
    calling thread, so the thread's clock sees every node; what is checked is where each spin's
    time goes, which the clock does not change."""
    from autopart.profiling import in_situ

    monkeypatch.setattr(in_situ.time, "perf_counter", time.thread_time)


class _Slow(torch.autograd.Function):
    """Identity that takes ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        _spin(forward_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _spin(ctx.backward_s)
        return grad * 1.0, None, None


def slow_a(x):
    return _Slow.apply(x, 0.002, 0.001)


def slow_b(x):
    return _Slow.apply(x, 0.0005, 0.003)


fx.wrap("slow_a")
fx.wrap("slow_b")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        y = slow_b(torch.relu(nn.functional.linear(slow_a(x), self.weight)))
        return (y * torch.rand_like(y)).sum()


def _trace(model: nn.Module) -> fx.GraphModule:
    """As autopart captures: parameters and buffers are get_attr nodes."""
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True
    return fx.GraphModule(model, tracer.trace(model))


def test_each_node_gets_its_own_time_in_the_whole_graph(cpu_clock) -> None:
    module = _trace(_Model())
    x = torch.randn(4, 8, requires_grad=True)
    rng = torch.get_rng_state()
    started = time.monotonic()
    times = time_in_situ(module, [x], repeats=6, min_seconds=0.4)
    assert time.monotonic() - started >= 0.4  # the runs span the time asked for (in CPU time, so in wall time too)
    names = {n.name: n for n in module.graph.nodes}
    a = next(k for k, n in names.items() if n.op == "call_function" and n.target is slow_a)
    b = next(k for k, n in names.items() if n.op == "call_function" and n.target is slow_b)
    # each spin lands on the node that spins, in forward and in backward, and nowhere else: a spin
    # charged to the other node would take its own below the lower bound; the upper bounds leave
    # room for the instrumentation's own time (CPU time: another process's turns do not count)
    assert 0.0019 < times[a].forward_s < 0.005 and 0.0009 < times[a].backward_s < 0.004
    assert 0.0004 < times[b].forward_s < 0.0035 and 0.0028 < times[b].backward_s < 0.006
    for name, node_times in times.items():
        if name not in (a, b):
            assert node_times.forward_s < 0.0004 and node_times.backward_s < 0.0004, name
    # the parameters' reads and gradient accumulation are charged to the linear that reads them
    assert not any(names[n].op == "get_attr" for n in times)
    linear = next(k for k, n in names.items() if n.target is nn.functional.linear)
    assert times[linear].backward_s > 0
    # the module is left as it was: no gradients, buffers and random state unchanged
    assert all(p.grad is None for p in module.parameters())
    assert module.steps.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_timing_in_place_leaves_no_hook_behind() -> None:
    """A backward hook that held its autograd node kept the node alive for ever, and with it the
    parameter's gradient accumulator, which every later backward reused: each run of the profile
    added a hook more to it, and every later run of the model called them all, slower each time."""
    import gc

    module = _trace(_Model())
    x = torch.randn(4, 8, requires_grad=True)
    time_in_situ(module, [x], repeats=10, min_seconds=0.0)

    def objects_after(runs: int) -> int:
        for _ in range(runs):
            module(x).backward()
        gc.collect()
        return len(gc.get_objects())

    before = objects_after(2)
    assert objects_after(20) - before < 10  # each leftover hook kept a record of every later run
    for parameter in module.parameters():
        parameter.grad = None


def test_in_situ_times_are_averaged_per_key_and_split_as_the_op_split_alone() -> None:
    class Timer:
        timed = {"op(a)": OpTimes(forward_s=1.0, backward_input_s=3.0, backward_weight_s=1.0),
                 "op(b)": OpTimes(forward_s=5.0),
                 "op(c)": OpTimes(forward_s=7.0, backward_input_s=1.0)}
        nodes = {"op(a)": ["a1", "a2"], "op(b)": ["b"], "op(c)": ["c"]}
        whole_backward = {"a1", "a2", "b", "c"}

    from autopart.profiling.in_situ import NodeTimes

    in_situ = {"a1": NodeTimes(forward_s=2.0, backward_s=4.0), "a2": NodeTimes(forward_s=4.0, backward_s=12.0),
               "b": NodeTimes(forward_s=6.0, backward_s=0.5)}
    database = CostDatabase()
    put_in_situ(database, "cpu", Timer(), in_situ)
    assert database.get("cpu", "op(a)") == OpTimes(forward_s=3.0, backward_input_s=6.0, backward_weight_s=2.0)
    assert database.get("cpu", "op(b)") == OpTimes(forward_s=6.0, backward_input_s=0.5, backward_weight_s=0.0)
    assert database.get("cpu", "op(c)") == Timer.timed["op(c)"]  # not seen in place: timed alone


def test_a_frozen_nodes_backward_is_not_averaged_into_its_keys() -> None:
    """A frozen layer's op runs no backward in the whole graph (nothing trained feeds it) while the
    same op in a trained layer runs it: the key's backward is the trained node's, not half of it.
    Where none of a key's nodes runs its whole backward (a trained linear fed by frozen layers
    computes no input gradient), the backward is as timed alone."""
    class Timer:
        timed = {"op(a)": OpTimes(forward_s=1.0, backward_input_s=3.0, backward_weight_s=1.0),
                 "op(b)": OpTimes(forward_s=1.0, backward_input_s=3.0, backward_weight_s=1.0)}
        nodes = {"op(a)": ["frozen", "trained"], "op(b)": ["weights_only"]}
        whole_backward = {"trained"}

    from autopart.profiling.in_situ import NodeTimes

    in_situ = {"frozen": NodeTimes(forward_s=2.0, backward_s=0.0), "trained": NodeTimes(forward_s=2.0, backward_s=8.0),
               "weights_only": NodeTimes(forward_s=2.0, backward_s=2.0)}
    database = CostDatabase()
    put_in_situ(database, "cpu", Timer(), in_situ)
    assert database.get("cpu", "op(a)") == OpTimes(forward_s=2.0, backward_input_s=6.0, backward_weight_s=2.0)
    assert database.get("cpu", "op(b)") == OpTimes(forward_s=2.0, backward_input_s=3.0, backward_weight_s=1.0)


def test_an_optimizer_step_pays_its_fixed_cost_once() -> None:
    database = CostDatabase()
    database.put("cpu", optimizer_call_key("adamw"), OpTimes(forward_s=1e-3))
    database.put("cpu", optimizer_key("adamw", (4, 4), "float32"), OpTimes(forward_s=1e-4))
    model = ProfiledCostModel(roofline=RooflineCostModel(device=load_device("cpu")), database=database)
    assert model.optimizer_time("adamw", [((4, 4), "float32")] * 3) == pytest.approx(1.3e-3)
    assert model.optimizer_time("adamw", []) == 0.0


def test_fixed_and_per_item_separates_a_calls_own_cost_from_its_items(monkeypatch) -> None:
    """The fit, with each timing the call's own figure (a timed spin would measure this machine's
    load as well): 2 ms a call and 0.5 ms an item, one round's timings caught by a 40 ms burst,
    which the median over the three rounds leaves out."""
    rounds = iter(range(100))
    burst = {n: 0.04 if n == 4 else 0.0 for n in (1, 2, 4, 8)}

    def timed(call, **_):
        n, seconds = call()
        return seconds + (burst[n] if next(rounds) < 4 else 0.0)  # the first round's timings

    monkeypatch.setattr(profiler, "measure", timed)
    fixed, per_item = fixed_and_per_item(lambda n: lambda: (n, 0.002 + n * 0.0005), device=torch.device("cpu"),
                                         rounds=3)
    assert fixed == pytest.approx(0.002) and per_item == pytest.approx(0.0005)


def _children() -> set[int]:
    """This process's child processes, living or not yet waited for (Linux)."""
    files = list(Path("/proc/self/task").glob("*/children"))
    if not files:
        pytest.skip("this kernel does not list a process's children (/proc/PID/task/TID/children)")
    return {int(pid) for path in files for pid in path.read_text().split()}


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(os, "sched_setaffinity"), reason="needs fork and affinity")
def test_measuring_the_resume_cost_leaves_no_process_and_the_affinity_as_it_was() -> None:
    module = _trace(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)))
    affinity = os.sched_getaffinity(0)
    children = _children()  # a session-wide helper (tests/rank_zygote.py) may be one already
    forward, backward = measure_resume(module, [torch.randn(4, 16)], repeats=3)
    assert forward >= 0.0 and backward >= 0.0
    assert os.sched_getaffinity(0) == affinity
    assert _children() == children
    assert all(p.grad is None for p in module.parameters())


def test_optimizer_in_situ_times_a_step_after_the_graph_and_leaves_the_module_as_it_was(cpu_clock) -> None:
    module = _trace(_Model())
    x = torch.randn(4, 8, requires_grad=True)
    rng = torch.get_rng_state()
    stepped: list[int] = []

    def make_step(weights: list[torch.Tensor]):
        assert [w.shape for w in weights] == [p.shape for p in module.parameters()]
        assert all(w is not p for w, p in zip(weights, module.parameters()))  # copies: the weights stay

        def step() -> None:
            stepped.append(len(weights))
            _spin(0.001)
        return step

    before = [p.detach().clone() for p in module.parameters()]
    seconds = optimizer_in_situ(module, [x], make_step, repeats=5, min_seconds=0.0)
    assert 0.0009 < seconds < 0.003 and len(stepped) == 6  # the state's first step, then five timed
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    assert all(p.grad is None for p in module.parameters())
    assert module.steps.item() == 0 and torch.equal(torch.get_rng_state(), rng)


def test_fresh_optimizer_figures_are_scaled_to_the_step_measured_in_place() -> None:
    from autopart.profiling.profile import time_optimizer

    weights = [torch.zeros(16, 16), torch.zeros(16)]
    database = CostDatabase()
    model = ProfiledCostModel(roofline=RooflineCostModel(device=load_device("cpu")), database=database)
    shapes = [((16, 16), "float32"), ((16,), "float32")]
    time_optimizer(database, "cpu", torch.device("cpu"), "adamw", weights, in_step=lambda make: 0.01)
    assert model.optimizer_time("adamw", shapes) == pytest.approx(0.01)  # the whole step as measured in place
    saved = dict(database.entries)
    time_optimizer(database, "cpu", torch.device("cpu"), "adamw", weights, in_step=lambda make: 1.0)
    assert database.entries == saved  # nothing fresh, nothing timed or scaled
    # a new shape beside known ones: only the new figure moves, so that the total is the measured one
    time_optimizer(database, "cpu", torch.device("cpu"), "adamw", [*weights, torch.zeros(8)], in_step=lambda make: 0.02)
    assert {k: v for k, v in database.entries.items() if k in saved} == saved
    assert model.optimizer_time("adamw", [*shapes, ((8,), "float32")]) == pytest.approx(0.02)


def test_a_fresh_shape_timed_at_zero_still_takes_the_measured_shortfall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slope below the clock's resolution comes out 0; the step measured in place still holds
    that shape's time, so the fresh figures share what the known ones leave over."""
    from autopart.profiling import profile

    monkeypatch.setattr(profile, "fixed_and_per_item", lambda *args, **kwargs: (0.0, 0.0))
    database = CostDatabase()
    model = ProfiledCostModel(roofline=RooflineCostModel(device=load_device("cpu")), database=database)
    weights, shapes = [torch.zeros(16, 16), torch.zeros(16)], [((16, 16), "float32"), ((16,), "float32")]
    profile.time_optimizer(database, "cpu", torch.device("cpu"), "adamw", weights, in_step=lambda make: 0.01)
    assert model.optimizer_time("adamw", shapes) == pytest.approx(0.01)
    profile.time_optimizer(database, "cpu", torch.device("cpu"), "adamw", [*weights, torch.zeros(8)],
                           in_step=lambda make: 0.02)
    assert model.optimizer_time("adamw", [*shapes, ((8,), "float32")]) == pytest.approx(0.02)


def test_an_overhead_found_by_difference_holds_while_the_machine_slows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls of 5 and 7 units (``2·5 − 7 = 3``) on a clock that runs four times slower after
    a while: the medians of two runs timed one after the other would give 2·5 − 28 < 0."""
    from cost_models import profiler

    clock = {"now": 0.0, "calls": 0}

    def advance(units: float) -> None:
        clock["calls"] += 1
        clock["now"] += units * (4 if clock["calls"] > 300 else 1) * 1e-6

    monkeypatch.setattr(profiler.time, "perf_counter", lambda: clock["now"])
    found = profiler._difference(lambda: advance(5), lambda: advance(7), scale=2, device=torch.device("cpu"),
                                 repeats=200, budget_s=1.0)
    assert found == pytest.approx(3e-6)
