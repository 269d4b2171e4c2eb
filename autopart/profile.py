"""The profile pass: time every op of the training graph on the device at hand.

``profile_costs(graph, spec, database, ...) -> int`` runs the graph once on the example batch
at a microbatch size and, for every node whose key (`autopart.annotate.op_key`: op, shapes,
dtypes, roles) the database lacks for this device and torch version, times its forward and its
two backward halves (`cost_models.profiler.time_op`). Repeated layers produce the same keys, so
they are timed once; a second run over the same model times nothing. It also times one
optimizer step per parameter shape and, once per device, the fixed costs of the runtime.

On the CPU ops are timed with one thread: that is what every rank runs with under torchrun
(which sets ``OMP_NUM_THREADS=1`` when it starts several processes).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from torch import fx

from autopart.annotate import _run_one, leaves_for_grad, op_key
from autopart.capture import Graph, ModelSpec, graph_args
from autopart.errors import ConfigError
from autopart.runtime.optim import make_optimizer
from cost_models.database import CostDatabase, OpTimes
from cost_models.devices import local_device_name
from cost_models.profiled import optimizer_key
from cost_models.profiler import measure, measure_overheads, time_op

__all__ = ["profile_costs", "torch_device"]


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
    """Runs the graph without autograd and times each node it has not seen, with autograd."""

    def __init__(self, module: fx.GraphModule, database: CostDatabase, device: torch.device, device_name: str,
                 progress: Progress | None):
        super().__init__(module)
        self.database, self.device, self.device_name = database, device, device_name
        self.parameters = {id(p) for p in module.parameters()}
        self.overheads = database.overheads[device_name]
        self.progress = progress
        self.task = progress.add_task("profiling", total=sum(n.op.startswith("call") for n in module.graph.nodes)) if progress else None

    def run_node(self, node: fx.Node) -> Any:
        value = super().run_node(node)
        if node.op not in ("call_function", "call_method"):
            return value
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        key = op_key(node, args, kwargs, self.parameters)
        if self.database.get(self.device_name, key) is None:
            if self.progress is not None:
                self.progress.update(self.task, description=f"timing {key[:70]}")
            fresh_args, fresh_kwargs, inputs, weights = leaves_for_grad(args, kwargs, self.parameters, clone=True)
            with torch.enable_grad():
                times = time_op(lambda: _run_one(node, fresh_args, fresh_kwargs), inputs=inputs, weights=weights,
                                device=self.device, overheads=self.overheads)
            self.database.put(self.device_name, key, times)
        if self.progress is not None:
            self.progress.advance(self.task)
        return value


def _time_optimizer(database: CostDatabase, device_name: str, device: torch.device, optimizer: str,
                    parameters: list[torch.Tensor]) -> None:
    for parameter in parameters:
        shape, dtype = tuple(parameter.shape), str(parameter.dtype).removeprefix("torch.")
        key = optimizer_key(optimizer, shape, dtype)
        if database.get(device_name, key) is not None:
            continue
        weight = torch.zeros(shape, dtype=parameter.dtype, device=device, requires_grad=True)
        weight.grad = torch.full_like(weight, 1e-3)
        step = make_optimizer(optimizer, [weight], 1e-3)
        database.put(device_name, key, OpTimes(forward_s=measure(step.step, device=device)))


def profile_costs(graph: Graph, spec: ModelSpec, database: CostDatabase, *, device: str = "cpu",
                  micro_batch_size: int, optimizer: str = "adamw", threads: int = 1,
                  console: Console | None = None) -> int:
    """Time what ``database`` lacks for this model at ``micro_batch_size``; return how many were timed."""
    where = torch_device(device)
    device_name = local_device_name(device)
    before = database.timed
    previous_threads = torch.get_num_threads()
    if where.type == "cpu":
        torch.set_num_threads(threads)
    try:
        if device_name not in database.overheads:
            database.overheads[device_name] = measure_overheads(where)
        module = graph.module if where.type == "cpu" else copy.deepcopy(graph.module).to(where)
        inputs, target = spec.example(micro_batch_size)
        values = [v.to(where) if isinstance(v, torch.Tensor) else v for v in graph_args(graph, inputs, target)]
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            console=console, transient=True) if console is not None else None
        with progress or nullcontext(), torch.no_grad():
            _Timer(module, database, where, device_name, progress).run(*values)
        _time_optimizer(database, device_name, where, optimizer, list(dict.fromkeys(module.parameters())))
    finally:
        torch.set_num_threads(previous_threads)
    return database.timed - before
