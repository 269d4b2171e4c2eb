"""Load a model file and capture the model and its loss as one torch.fx graph.

Two passes live here, because both speak the model-file contract:

- ``load_model_file(path) -> ModelSpec`` imports ``model.py`` and checks the contract
  (``build_model``, ``example_batch``, optional ``loss_fn`` and ``batches``);
- ``capture(spec) -> Graph`` traces model and loss together into one ``GraphModule`` whose
  placeholders are the model's inputs followed by ``target`` and whose output is the loss.

Tracing goes *through* every module, so each op is a plain function call with explicit weights
(``F.linear(x, self.h.0.attn.c_attn.weight, ...)``); that is what lets later passes move any op
to any stage and shard any weight. Parameters keep their original qualified names.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from autopart.errors import CaptureError, ModelFileError

__all__ = ["ModelSpec", "Graph", "load_model_file", "capture", "TARGET"]

TARGET = "target"
"""Name of the graph placeholder that carries the loss target."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What a user's ``model.py`` provides, checked against the contract."""

    path: Path
    source_sha256: str
    module: nn.Module | None  # None when loaded for its data functions only
    example_batch: Callable[[int], tuple[tuple[Any, ...], Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    batches: Callable[[int, int], Iterator[tuple[tuple[Any, ...], Any]]] | None

    def example(self, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The example batch at ``batch_size``, checked to be ``(tuple of tensors, target)``."""
        return check_batch(self.path, "example_batch", self.example_batch(batch_size), batch_size)


@dataclass(frozen=True, kw_only=True)
class Graph:
    """The training graph: model and loss, one fx graph, parameters under their own names."""

    module: fx.GraphModule
    method: str  # "fx" or "export"
    input_names: tuple[str, ...]  # placeholders, in call order; the last is TARGET when there is a loss
    has_target: bool


def _file_line(exc: BaseException, path: Path) -> str | None:
    """``model.py:LINE`` of the innermost traceback frame that lies in the user's file."""
    where = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            where = f"{path.name}:{frame.lineno}"
    return where


def _describe(exc: BaseException, path: Path) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = _file_line(exc, path)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"{text} ({where})" if where else text


def load_model_file(path: str | Path, *, build: bool = True) -> ModelSpec:
    """Import ``path`` and return its ``ModelSpec``; every breach of the contract is a ModelFileError.

    ``build=False`` skips ``build_model()``: the runtime needs only the data functions.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(
            f"model file '{path}' does not exist; pass the path of a Python file that defines "
            "build_model() and example_batch()"
        )
    if path.suffix != ".py":
        raise ModelFileError(f"model file '{path}' is not a .py file; pass a Python model file")
    source = path.read_bytes()
    name = f"_autopart_model_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code may raise anything
        sys.modules.pop(name, None)
        raise ModelFileError(f"importing {path.name} failed: {_describe(exc, path)}; fix the model file") from None
    finally:
        sys.path.remove(folder)

    build_model = _contract_function(module, path, "build_model", required=True)
    example_batch = _contract_function(module, path, "example_batch", required=True)
    loss_fn = _contract_function(module, path, "loss_fn", required=False)
    batches = _contract_function(module, path, "batches", required=False)
    model = None
    try:
        if build:
            model = build_model()
    except Exception as exc:
        raise ModelFileError(f"build_model() in {path.name} raised {_describe(exc, path)}") from None
    if build and not isinstance(model, nn.Module):
        raise ModelFileError(
            f"build_model() in {path.name} returned {type(model).__name__}, not a torch.nn.Module; "
            "return the model instance"
        )
    return ModelSpec(
        path=path,
        source_sha256=hashlib.sha256(source).hexdigest(),
        module=model,
        example_batch=example_batch,
        loss_fn=loss_fn,
        batches=batches,
    )


def _contract_function(module: Any, path: Path, name: str, *, required: bool) -> Callable | None:
    fn = getattr(module, name, None)
    if fn is None:
        if required:
            signature = {
                "build_model": "def build_model() -> nn.Module",
                "example_batch": "def example_batch(batch_size: int) -> (inputs: tuple, target)",
            }[name]
            raise ModelFileError(
                f"{path.name} does not define {name}(); add `{signature}` (see the model-file contract in the README)"
            )
        return None
    if not callable(fn):
        raise ModelFileError(f"{name} in {path.name} is a {type(fn).__name__}, not a function; define it with def")
    return fn


def check_batch(path: Path, producer: str, batch: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Check one ``(inputs, target)`` pair from the model file and return it normalised."""
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise ModelFileError(
            f"{producer}() in {path.name} returned {type(batch).__name__}; it must return (inputs: tuple, target)"
        )
    inputs, target = batch
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple | list) or not inputs:
        raise ModelFileError(f"{producer}() in {path.name} must return a non-empty tuple of input tensors first")
    for i, tensor in enumerate([*inputs, target]):
        if tensor is None and i == len(inputs):
            continue
        what = f"input {i}" if i < len(inputs) else "the target"
        if not isinstance(tensor, torch.Tensor):
            raise ModelFileError(
                f"{producer}() in {path.name}: {what} is a {type(tensor).__name__}, not a tensor; "
                "inputs and target must be tensors whose first dimension is the batch"
            )
        if tensor.dim() == 0 or tensor.shape[0] != batch_size:
            raise ModelFileError(
                f"{producer}({batch_size}) in {path.name}: {what} has shape {tuple(tensor.shape)}, "
                f"whose first dimension is not the batch size {batch_size}"
            )
    return tuple(inputs), target


class _ThroughTracer(fx.Tracer):
    """Traces through every module, so that each op is a function of explicit weights."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return False


def _concrete_defaults(forward: Callable, positional: int) -> dict[str, Any]:
    """Arguments past the example's inputs are fixed at their defaults while tracing."""
    parameters = list(inspect.signature(forward).parameters.values())
    return {
        p.name: p.default
        for p in parameters[positional:]
        if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD
    }


def _trace_fx(spec: ModelSpec, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    model = spec.module
    tracer = _ThroughTracer()
    graph = tracer.trace(model, concrete_args=_concrete_defaults(model.forward, len(inputs)) or None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise CaptureError(
            f"the model's forward takes {len(placeholders)} inputs but example_batch() gives {len(inputs)}; "
            "make them agree"
        )
    if spec.loss_fn is not None:
        output = next(n for n in graph.nodes if n.op == "output")
        model_output = output.args[0]
        graph.erase_node(output)
        with graph.inserting_after(placeholders[-1]):
            target = graph.placeholder(TARGET)
        loss_graph = _ThroughTracer().trace(spec.loss_fn)
        loss_inputs = [n for n in loss_graph.nodes if n.op == "placeholder"]
        if len(loss_inputs) != 2:
            raise CaptureError(f"loss_fn in {spec.path.name} must take exactly (output, target)")
        loss = graph.graph_copy(loss_graph, {loss_inputs[0]: model_output, loss_inputs[1]: target})
        graph.output(loss)
    graph.lint()
    return fx.GraphModule(model, graph, class_name="TrainingGraph")


def capture(spec: ModelSpec, *, batch_size: int = 2) -> Graph:
    """Trace model and loss into one graph and check that it computes the eager loss."""
    inputs, target = spec.example(batch_size)
    from autopart.codegen.names import check_model_names

    check_model_names(spec.module, spec.path.name)
    try:
        module = _trace_fx(spec, inputs)
    except CaptureError:
        raise
    except Exception as exc:
        where = _file_line(exc, spec.path)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "control flow" in reason or "TraceError" in type(exc).__name__:
            reason = "data-dependent control flow cannot be traced by torch.fx"
        at = f" at {where}" if where else ""
        raise CaptureError(
            f"torch.fx could not trace {spec.path.name}{at}: {reason}; rewrite that code without "
            "Python control flow on tensor values"
        ) from None
    has_target = spec.loss_fn is not None
    names = tuple(n.name for n in module.graph.nodes if n.op == "placeholder")
    graph = Graph(module=module, method="fx", input_names=names, has_target=has_target)
    _check_same_loss(spec, graph, inputs, target)
    return graph


def eager_loss(spec: ModelSpec, inputs: tuple[torch.Tensor, ...], target: Any) -> torch.Tensor:
    """The loss of the original model, run eagerly: the reference that every graph must match."""
    output = spec.module(*inputs)
    return output if spec.loss_fn is None else spec.loss_fn(output, target)


def graph_args(graph: Graph, inputs: tuple[torch.Tensor, ...], target: Any) -> tuple[Any, ...]:
    return (*inputs, target) if graph.has_target else tuple(inputs)


def _check_same_loss(spec: ModelSpec, graph: Graph, inputs: tuple[torch.Tensor, ...], target: Any) -> None:
    with torch.no_grad():
        try:
            expected = eager_loss(spec, inputs, target)
        except Exception as exc:
            raise ModelFileError(
                f"the model rejects its own example batch: {_describe(exc, spec.path)}; "
                "make example_batch() match the model's forward"
            ) from None
        got = graph.module(*graph_args(graph, inputs, target))
    if not isinstance(expected, torch.Tensor) or expected.numel() != 1:
        raise ModelFileError(
            f"the loss of {spec.path.name} is not a scalar tensor; define loss_fn(output, target) "
            "that returns the mean loss, or make the model return it"
        )
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        raise CaptureError(
            f"the captured graph computes loss {got.item():.6g} but the model computes {expected.item():.6g}; "
            "the model has behaviour that tracing cannot see (randomness, global state); report this model"
        )
