"""The profile pass: time every op of the training graph on the device at hand.

``profile_costs(graph, spec, database, ...) -> int`` runs the graph once on the example batch
at a microbatch size and, for every node whose key (`autopart.passes.cost_keys.op_key`: op, shapes,
dtypes, roles) the database lacks for this device and torch version, times its forward and its
two backward halves (`cost_models.profiler.time_op`). Repeated layers produce the same keys, so
they are timed once; a second run over the same model times nothing. It also times one
optimizer step per parameter shape (scaled, on the CPU, to a whole step measured right after
the graph's backward, `autopart.profiling.in_situ.optimizer_in_situ`) and, once per device, the
fixed costs of the runtime; and, given the processes that the plan's ranks on one host run at
once, how much slower the graph computes beside as many copies of itself (`autopart.profiling.co_run`).

On the CPU ops are timed with one thread: that is what every rank runs with under torchrun
(which sets ``OMP_NUM_THREADS=1`` when it starts several processes), and where they run: the
whole graph's forward and backward (`autopart.profiling.in_situ`), because an op timed alone in a
loop is much faster than the same op in a step. Timed alone, each op still gives the split of
its backward into the input- and the weight-gradient halves, which zero-bubble schedules run
apart and which the whole backward does not separate. On a GPU ops are timed alone, with CUDA
events.

With a bf16 ``dtype`` every forward runs under ``torch.autocast`` of the device (CUDA's on a GPU,
the CPU's on the CPU), as the generated programs run it; backward runs outside autocast, as
there. Under ``bf16`` the ops read bf16 working copies of the weights and each weight gradient
is cast back to fp32, as the stages run them (`_working`). Each op is stored under the key that a compile looks it up by (`autopart.passes.cost_keys.cost_key`),
which names its arguments' dtypes as annotate sees them: annotate runs the graph on the CPU under
the target's autocast as ``autopart.passes.annotate.target_precision`` applies it (CUDA's casts for a GPU).
The keys therefore come from one run of the graph on the CPU under that same precision
(`_compile_keys`), whatever device the ops are timed on.
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from torch import fx, nn

from autopart.ir.tensors import DTYPES, precision, working_dtype
from autopart.passes.annotate import mixed_dtype_error, run_one, target_precision
from autopart.passes.cost_keys import cost_key
from autopart.passes.grad_flow import GradientFlow, trainable_parameters
from autopart.passes.grad_leaves import leaves_for_grad
from autopart.ir.model_file import ModelSpec, is_meta
from autopart.passes.capture import Graph, graph_args
from autopart.ir.errors import ConfigError
from autopart.profiling.co_run import co_run_key, measure_co_run
from autopart.profiling.in_situ import NodeTimes, measure_resume, optimizer_in_situ, time_in_situ
from autopart.runtime.materialise import check_initialisers, materialise, meta_names
from autopart.runtime.optim import make_optimizer
from autopart.runtime.stage import stage_tensors
from cost_models.calibration import physical_memory_bytes
from cost_models.database import CostDatabase, OpTimes
from cost_models.devices import local_device_name
from cost_models.profiled import optimizer_call_key, optimizer_key
from cost_models.profiler import fixed_and_per_item, measure_overheads, time_op

__all__ = ["profile_costs", "torch_device", "made_to_time"]


def torch_device(kind: str) -> torch.device:
    """The device that ``--device cpu|cuda`` names, checked to be present."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is visible here; profile on a GPU machine or use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    raise ConfigError(f"can only profile on cpu or cuda, got --device {kind!r}")


class _Timer(fx.Interpreter):
    """Runs the graph without autograd and times alone each op the database lacks, with autograd.

    ``timed`` holds those times by key and ``nodes`` the nodes of each such key: the repeated
    layers give one key several nodes, timed once."""

    def __init__(self, module: fx.GraphModule, database: CostDatabase, device: torch.device, device_name: str,
                 progress: Progress | None, dtype: str, keys: dict[str, str]):
        super().__init__(module)
        self.database, self.device, self.device_name, self.dtype = database, device, device_name, dtype
        self.keys = keys
        self.parameters = {id(p) for p in module.parameters()}
        self.frozen = {id(p) for p in module.parameters() if not p.requires_grad}
        self.master = torch.float32 if working_dtype(dtype) is not None else None  # bf16: weights cast from fp32
        self.overheads = database.overheads[device_name]
        self.progress = progress
        self.timed: dict[str, OpTimes] = {}
        self.nodes: dict[str, list[str]] = {}
        self.flow = GradientFlow(trainable_parameters(module))
        self.whole_backward: set[str] = set()  # the nodes whose backward training runs, both halves
        self.task = progress.add_task("profiling", total=sum(n.op.startswith("call") for n in module.graph.nodes)) if progress else None

    def _precision(self):
        return precision(self.dtype, self.device.type)

    def run_node(self, node: fx.Node) -> Any:
        with self._precision():
            value = super().run_node(node)
        if self.flow.visit(node, value) and self.flow.input_gradient(node, self.flow.trainable):
            self.whole_backward.add(node.name)
        if node.op not in ("call_function", "call_method"):
            return value
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        key = self.keys[node.name]
        if self.database.get(self.device_name, key) is None:
            self.nodes.setdefault(key, []).append(node.name)
        if self.database.get(self.device_name, key) is None and key not in self.timed:
            if self.progress is not None:
                self.progress.update(self.task, description=f"timing {key[:70]}")
            fresh_args, fresh_kwargs, inputs, weights = leaves_for_grad(args, kwargs, self.parameters, clone=True,
                                                                         master=self.master, frozen=self.frozen)
            with torch.enable_grad():
                times = time_op(lambda: self._forward(node, fresh_args, fresh_kwargs), inputs=inputs,
                                weights=weights, device=self.device, overheads=self.overheads)
            self.timed[key] = times
        if self.progress is not None:
            self.progress.advance(self.task)
        return value


    def _forward(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        with self._precision():
            return run_one(node, args, kwargs)


def _working(module: fx.GraphModule, dtype: str) -> fx.GraphModule:
    """The module as ``dtype``'s ops read it: under ``bf16`` a copy whose weights are the bf16
    working copies that the stages and annotate use (the optimizer steps the fp32 ones)."""
    lower = working_dtype(dtype)
    if lower is None:
        return module
    copied = copy.deepcopy(module)
    for parameter in copied.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(lower)
    return copied


def made_to_time(module: fx.GraphModule, spec: ModelSpec) -> fx.GraphModule:
    """The module with weights to time it by. A model built on the meta device is made on the CPU
    as each rank makes its stage (the model file's initialisers, on a copy of the model itself: the
    captured graph's owners are plain modules that no ``init_weights`` recognises), and its tensors
    go into a copy of the graph by name; a tensor the model does not name (an export's) gets small
    normal values, so that nothing is timed on uninitialised memory. The captured graph the rest
    of the compile reads stays on meta."""
    if not is_meta(module):
        return module
    made = copy.deepcopy(spec.module)
    weights = _made_bytes(made)
    if weights > physical_memory_bytes() // 2:
        raise ConfigError(
            f"{spec.path.name} holds {weights / 2**30:.1f} GiB of weights, more than this machine can make to "
            "time its ops in place; compile for a named device (--device h100-sxm ...) or with --costs COSTS.json"
        )
    check_initialisers(made, spec.init_weights, spec.path.name)
    source = materialise(made, meta_names(made), init=spec.init_weights, device="cpu")
    graph = copy.deepcopy(module)
    kept = {n: t.clone() for n, t in stage_tensors(graph).items() if not t.is_meta}  # made by the model itself
    graph.to_empty(device="cpu")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, tensor in stage_tensors(graph).items():
            made_here = kept.get(name, source.get(name))
            if made_here is not None and made_here.shape == tensor.shape:
                tensor.copy_(made_here)
            elif tensor.is_floating_point():
                tensor.normal_(0.0, 0.02)
            else:
                tensor.zero_()
    return graph


def _made_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers once made (shared ones once)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _compile_keys(module: fx.GraphModule, values: list[Any], dtype: str, device_kind: str) -> dict[str, str]:
    """Per op node, the key a compile in ``dtype`` for a ``device_kind`` device looks it up by: the
    graph run on the CPU under that device's autocast, as annotate runs it (see the module's docstring)."""
    parameters = {id(p) for p in module.parameters()}
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    keys: dict[str, str] = {}

    class Keys(fx.Interpreter):
        current = ""  # the node running, named in an error

        def run_node(self, node: fx.Node) -> Any:
            self.current = node.name
            with target_precision(dtype, device_kind):
                value = super().run_node(node)
            if node.op in ("call_function", "call_method"):
                args, kwargs = self.fetch_args_kwargs_from_env(node)
                keys[node.name] = cost_key(node, args, kwargs, parameters, dtype, frozen)
            return value

    runner = Keys(module)
    with torch.no_grad():
        try:
            runner.run(*values)
        except RuntimeError as exc:
            raise mixed_dtype_error(exc, runner.current, dtype) from None
    return keys


def time_optimizer(database: CostDatabase, device_name: str, device: torch.device, optimizer: str,
                    parameters: list[torch.Tensor], in_step: Callable[[Callable], float] | None = None) -> None:
    """Once, the fixed cost of a ``step()``; per parameter shape, what one parameter adds to it.

    Both from steps over several parameters: a step over one parameter pays the fixed cost as
    well, and a rank steps all its parameters in one call. The fixed cost is the intercept over
    1 to 8 tiny parameters; a shape's share the slope over 1 to 3 parameters of that shape.
    With ``in_step`` (the CPU's `optimizer_in_situ`, given a maker of the step), the figures
    timed now are scaled so that the model's whole step costs what it measured in a training
    step, where caches no longer hold what a step alone in a loop found there.
    """
    def step_over(count: int, shape: tuple[int, ...] = (4,), dtype: torch.dtype = torch.float32) -> Any:
        weights = [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(count)]
        for weight in weights:
            weight.grad = torch.full_like(weight, 1e-3)
        return make_optimizer(optimizer, weights, 1e-3).step

    call_key = optimizer_call_key(optimizer)
    fresh: dict[str, float] = {}
    if database.get(device_name, call_key) is None:
        fresh[call_key], _ = fixed_and_per_item(step_over, device=device)
    keys = [optimizer_key(optimizer, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in parameters]
    for parameter, key in zip(parameters, keys):
        if database.get(device_name, key) is None and key not in fresh:
            _, fresh[key] = fixed_and_per_item(lambda n: step_over(n, tuple(parameter.shape), parameter.dtype),
                                               device=device, counts=(1, 2, 3))
    if fresh and in_step is not None:
        known = sum(database.get(device_name, k).forward_s for k in [call_key, *keys] if k not in fresh)
        measured = in_step(lambda weights: make_optimizer(optimizer, weights, 1e-3).step)
        fresh = _scaled_to(fresh, [k for k in [call_key, *keys] if k in fresh], measured - known)
    for key, seconds in fresh.items():
        database.put(device_name, key, OpTimes(forward_s=seconds))


def _scaled_to(fresh: dict[str, float], uses: list[str], missing_s: float) -> dict[str, float]:
    """``fresh`` scaled so that its ``uses`` (a key once per parameter) sum to ``missing_s``, what
    the step measured in place holds beyond the figures already known. A slope timed alone can
    come out 0 on a tiny shape (noise below the clock); then the missing time is shared evenly,
    so that a new shape never leaves the step short of what was measured."""
    timed = sum(fresh[k] for k in uses)
    if timed > 0:
        scale = max(0.5, missing_s / timed)  # never below half what was timed alone
        return {key: scale * seconds for key, seconds in fresh.items()}
    share = max(0.0, missing_s) / len(uses)
    return {key: share for key in fresh}


def put_in_situ(database: CostDatabase, device_name: str, timer: _Timer, in_situ: dict[str, NodeTimes]) -> None:
    """Per key, the mean over its nodes of their in-place times; the backward split into its
    halves as the op split it when timed alone. The backward's mean is over the nodes whose whole
    backward training runs (a frozen layer's op runs none, `autopart.passes.grad_flow`, and the
    same op in a trained one both halves): where the key has none here, as timed alone."""
    for key, alone in timer.timed.items():
        nodes = [in_situ[n] for n in timer.nodes[key] if n in in_situ]
        if not nodes:
            database.put(device_name, key, alone)
            continue
        forward = sum(n.forward_s for n in nodes) / len(nodes)
        running = [in_situ[n] for n in timer.nodes[key] if n in in_situ and n in timer.whole_backward]
        backward = sum(n.backward_s for n in running) / len(running) if running else alone.backward_s
        weight_share = alone.backward_weight_s / alone.backward_s if alone.backward_s > 0 else 0.0
        database.put(device_name, key, OpTimes(forward_s=forward, backward_input_s=backward * (1 - weight_share),
                                               backward_weight_s=backward * weight_share))


def _frees_its_copies(profile: Callable[..., int]) -> Callable[..., int]:
    """``profile`` that, as it returns, frees the copies of the model it made: a GraphModule and
    its Graph refer to each other, so only the cycle collector frees one, and a compile runs with
    the collector off (`autopart.driver.cycle_collector_off`). The young generation holds what
    was made since the collector last ran (all of the compile so far, while it is off), not the
    caller's older objects."""
    @functools.wraps(profile)
    def freeing(*args: Any, **kwargs: Any) -> int:
        try:
            return profile(*args, **kwargs)
        finally:
            gc.collect(0)

    return freeing


@_frees_its_copies
def profile_costs(graph: Graph, spec: ModelSpec, database: CostDatabase, *, device: str = "cpu",
                  micro_batch_size: int, optimizer: str = "adamw", threads: int = 1,
                  console: Console | None = None, dtype: str = "fp32", processes: int = 1,
                  in_situ_seconds: float | None = None) -> int:
    """Time what ``database`` lacks for this model at ``micro_batch_size`` in precision ``dtype``;
    return how many were timed; on the CPU the ops in place over ``in_situ_seconds`` (by default
    `autopart.profiling.in_situ.MIN_SECONDS`). On the CPU with ``processes`` > 1 (the ranks of the host that
    compute at once, `autopart.profiling.co_run.host_processes`), also how much slower the
    graph computes beside as many copies of itself, when the database lacks it."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown --dtype {dtype!r}; profile one of {', '.join(DTYPES)}")
    where = torch_device(device)
    device_name = local_device_name(device)
    before = database.timed
    previous_threads = torch.get_num_threads()
    if where.type == "cpu":
        torch.set_num_threads(threads)
    try:
        fresh_overheads = device_name not in database.overheads
        if fresh_overheads:
            database.overheads[device_name] = measure_overheads(where)
        on_host = made_to_time(graph.module, spec)
        module = on_host if where.type == "cpu" else copy.deepcopy(on_host).to(where)
        inputs, target = spec.example(micro_batch_size)
        on_cpu = graph_args(graph, inputs, target)
        keys = _compile_keys(_working(on_host, dtype), on_cpu, dtype, where.type)
        values = [v.to(where) if isinstance(v, torch.Tensor) else v for v in on_cpu]
        live = console is not None and console.is_terminal  # elsewhere rich leaves an empty line behind
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            console=console, transient=True) if live else None
        timed = _working(module, dtype)
        timer = _Timer(timed, database, where, device_name, progress, dtype, keys)
        with progress or nullcontext(), torch.no_grad():
            timer.run(*values)
        if timer.timed and where.type == "cpu":
            with _status(console, "timing every op in place, in the whole forward and backward (seconds)"):
                in_situ = time_in_situ(timed, values, min_seconds=in_situ_seconds,
                                       forward_context=partial(precision, dtype, where.type))
            put_in_situ(database, device_name, timer, in_situ)
        else:
            for key, times in timer.timed.items():
                database.put(device_name, key, times)
        if fresh_overheads and where.type == "cpu":
            forward, backward = measure_resume(module, values)
            database.overheads[device_name] = replace(database.overheads[device_name], resume_forward_s=forward,
                                                      resume_backward_s=backward)
        co_run = co_run_key(dtype, processes)
        if where.type == "cpu" and processes > 1 and database.co_run(device_name, co_run) is None:
            copies = "1 copy" if processes == 2 else f"{processes - 1} copies"
            with _status(console, f"timing the model beside {copies} of itself (the host's other ranks)"):
                measured = measure_co_run(module, values, processes=processes,
                                          forward_context=partial(precision, dtype, where.type))
            database.put_co_run(device_name, co_run, replace(measured, micro_batch_size=micro_batch_size))
        in_step = partial(optimizer_in_situ, module, values) if where.type == "cpu" else None
        trained = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]  # a frozen one is not stepped
        time_optimizer(database, device_name, where, optimizer, trained, in_step)
    finally:
        torch.set_num_threads(previous_threads)
    return database.timed - before


def _status(console: Console | None, what: str):
    """A spinner saying ``what`` is being measured, on ``console`` where there is one."""
    return console.status(what) if console is not None else nullcontext()
