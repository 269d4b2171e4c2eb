"""Load a model file and capture the model and its loss as one torch.fx graph.

Two passes live here, because both speak the model-file contract:

- ``load_model_file(path) -> ModelSpec`` imports ``model.py`` and checks the contract
  (``build_model``, ``example_batch``, optional ``loss_fn`` and ``batches``);
- ``capture(spec) -> Graph`` traces model and loss together into one ``GraphModule`` whose
  placeholders are the model's inputs followed by ``target`` and whose output is the loss.

Tracing goes *through* every module, so each op is a plain function call with explicit weights
(``F.linear(x, self.h.0.attn.c_attn.weight, ...)``); that is what lets later passes move any op
to any stage and shard any weight. Parameters keep their original qualified names. Modules of
the classes named by ``--leaf`` stay whole (``call_module`` nodes). When fx symbolic tracing
fails (Python control flow on shapes, asserts on sizes), ``torch.export`` captures the model
instead (``autopart/export.py``), into the same form. A model built on the meta device is
traced without running it; its graph is checked by running the model on meta tensors.
"""

from __future__ import annotations

import bisect
import contextlib
import dis
import functools
import inspect
import logging
import operator
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional as F

from autopart.ir.errors import CaptureError, ConfigError, ModelFileError
from autopart.ir.model_file import ModelSpec, describe_error, file_line, is_meta
from autopart.passes.buffer_writes import buffer_versions, check_fx_graph, check_inputs_unwritten
from autopart.passes.capture_checks import Example, check_same_loss, same_draws
from autopart.passes.custom_functions import check_same_gradients, traced_functions, used_functions
from autopart.passes.export import export_training_graph
from autopart.passes.loss_gradient import check_loss_takes_gradient
from autopart.passes.loss_reduction import UNKNOWN, reduction_of
from autopart.passes.shallow import repeated_layers, shallow_module

# A GraphModule that writes its Python code when it is first run or read, not when it is made or
# rewritten: the compiler reads the graph, and writing the code of a model of a thousand layers costs seconds.
# Private to torch.fx (in it since 2.3), hence the fallback.
try:
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover
    _GraphModule = fx.GraphModule

__all__ = ["Graph", "capture", "graph_args", "leaf_classes", "TARGET"]

log = logging.getLogger("autopart")

TARGET = "target"
"""Name of the graph placeholder that carries the loss target."""


@dataclass(frozen=True, kw_only=True)
class Graph:
    """The training graph: model and loss, one fx graph, parameters under their own names."""

    module: fx.GraphModule
    method: str  # "fx" or "export"
    input_names: tuple[str, ...]  # placeholders, in call order; the last is TARGET when there is a loss
    has_target: bool
    constants: tuple[str, ...] = ()  # get_attr targets that are not the model's tensors (made in forward)
    built_buffers: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """The model's buffers as build_model made them, before the capture's checks and annotate's
    timing ran forwards in training mode on them (BatchNorm's running statistics move): what the
    emitted weights hold, as the reference run starts from them."""
    loss_reduction: str = UNKNOWN  # how the loss reduces over the batch (`autopart.passes.loss_reduction`)


class _Proxy(fx.Proxy):
    """fx's Proxy, whose iteration (``q, k, v = qkv.split(...)``) finds how many values the calling
    line unpacks in a table of its function's bytecode made once: fx's own disassembles the whole
    calling function at every iteration, once per layer of a deep model."""

    def __iter__(self):
        caller = sys._getframe(1)
        count = _unpacked(caller.f_code, caller.f_lasti)
        return self.tracer.iter(self) if count is None else (self[i] for i in range(count))


def _unpacked(code: types.CodeType, offset: int) -> int | None:
    """How many values the instruction at (or first after) ``offset`` of ``code`` unpacks; None
    where it is no unpacking (fx then refuses to iterate, as it would)."""
    offsets, counts = _unpackings(code)
    k = bisect.bisect_left(offsets, offset)
    return counts.get(offsets[k]) if k < len(offsets) else None


@functools.lru_cache(maxsize=1024)
def _unpackings(code: types.CodeType) -> tuple[list[int], dict[int, int]]:
    """Every instruction's offset in ``code``, and the values each ``UNPACK_SEQUENCE`` unpacks."""
    instructions = list(dis.get_instructions(code))
    return ([i.offset for i in instructions],
            {i.offset: i.argval for i in instructions if i.opname == "UNPACK_SEQUENCE"})


class _ThroughTracer(fx.Tracer):
    """Traces through every module but those of the ``leaves`` classes, so that each op is a
    function of explicit weights."""

    def __init__(self, leaves: frozenset[type] = frozenset()):
        super().__init__()
        self.leaves = leaves
        self._names_of: tuple[nn.Module, dict[int, str], dict[int, str]] | None = None

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return type(module) in self.leaves

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        """fx's own rule (a module's parameter, or buffer, read as an attribute becomes one
        ``get_attr`` node, shared by every read), with the tensor's name found in a table made
        once: fx scans all the module's parameters at every read, which grows with the square
        of the layers (most of the capture of a 1,024-layer model)."""
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        parameters, buffers = self._names()
        name = parameters.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None and self.proxy_buffer_attributes:
            name = buffers.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def _names(self) -> tuple[dict[int, str], dict[int, str]]:
        """The root's parameters and buffers by identity, under their first names (as fx's scan finds them)."""
        if self._names_of is None or self._names_of[0] is not self.root:
            parameters: dict[int, str] = {}
            buffers: dict[int, str] = {}
            for name, tensor in self.root.named_parameters():
                parameters.setdefault(id(tensor), name)
            for name, tensor in self.root.named_buffers():
                buffers.setdefault(id(tensor), name)
            self._names_of = (self.root, parameters, buffers)
        return self._names_of[1], self._names_of[2]


def _concrete_defaults(forward: Callable, positional: int) -> dict[str, Any]:
    """Arguments past the example's inputs are fixed at their defaults while tracing."""
    parameters = list(inspect.signature(forward).parameters.values())
    return {
        p.name: p.default
        for p in parameters[positional:]
        if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD
    }


def _drop_fixed_arguments(graph: fx.Graph) -> None:
    """Remove the inputs fixed at their defaults (`_concrete_defaults`): fx keeps each as an input
    with its default, read only by a check that it still has that value; the model is trained at
    the default, which the graph holds as a constant, and takes the example's inputs alone."""
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.args]:  # args: (its default,)
        guards = list(node.users)
        if all(_is_check(g) or (g.target is operator.eq and all(_is_check(c) for c in g.users)) for g in guards):
            for guard in guards:
                for check in list(guard.users):
                    graph.erase_node(check)
                graph.erase_node(guard)
            graph.erase_node(node)


def _is_check(node: fx.Node) -> bool:
    """A check fx adds of an input fixed at its default: ``_assert(x == default)``, or that a
    ``None`` default is still None (``_assert_is_none``)."""
    return node.target is torch._assert or getattr(node.target, "__name__", "") == "_assert_is_none"


def _trace_fx(spec: ModelSpec, inputs: tuple[torch.Tensor, ...],
              leaves: frozenset[type]) -> tuple[fx.GraphModule, dict[str, str]]:
    """The model and its loss traced into one graph, and the model's own autograd.Functions that
    the trace ran (`autopart.passes.custom_functions`)."""
    model = spec.module
    tracer = _ThroughTracer(leaves)
    with traced_functions(tracer) as functions:
        graph = tracer.trace(model, concrete_args=_concrete_defaults(model.forward, len(inputs)) or None)
    _drop_fixed_arguments(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ModelFileError(
            f"the model's forward takes {len(placeholders)} inputs but example_batch() of {spec.path.name} gives "
            f"{len(inputs)}; make them agree (an input with a default may be left out)"
        )
    if spec.loss_fn is not None:
        output = next(n for n in graph.nodes if n.op == "output")
        model_output = output.args[0]
        graph.erase_node(output)
        with graph.inserting_after(placeholders[-1]):
            target = graph.placeholder(TARGET)
        loss_tracer = _ThroughTracer()
        with traced_functions(loss_tracer) as in_loss:
            loss_graph = loss_tracer.trace(spec.loss_fn)
        functions |= in_loss
        loss_inputs = [n for n in loss_graph.nodes if n.op == "placeholder"]
        if len(loss_inputs) != 2:
            raise ModelFileError(f"loss_fn in {spec.path.name} must take exactly (output, target)")
        loss = graph.graph_copy(loss_graph, {loss_inputs[0]: model_output, loss_inputs[1]: target})
        graph.output(loss)
    graph.lint()
    return _GraphModule(model, graph, class_name="TrainingGraph"), functions


def leaf_classes(module: nn.Module, names: tuple[str, ...]) -> frozenset[type]:
    """The module classes that ``--leaf`` names, found among the model's modules."""
    classes = {type(m).__name__: type(m) for m in module.modules()}
    classes.update({f"{type(m).__module__}.{type(m).__qualname__}": type(m) for m in module.modules()})
    found = set()
    for name in names:
        if name not in classes:
            known = ", ".join(sorted({type(m).__name__ for m in module.modules()})[:8])
            raise ConfigError(f"--leaf {name}: the model has no module of that class; its classes include {known}")
        if classes[name] is type(module):
            raise ConfigError(f"--leaf {name} names the model's own class; name a submodule's class")
        found.add(classes[name])
    return frozenset(found)


def _reason(exc: BaseException, path: Path) -> str:
    """One line on why a tracer failed, with the user's file and line when the traceback has them."""
    text = str(exc).strip()
    reason = text.splitlines()[0] if text else type(exc).__name__
    if "data-dependent" in text or "DataDependent" in type(exc).__name__:
        reason = "control flow on tensor values"
    elif "control flow" in reason or "TraceError" in type(exc).__name__:
        reason = "Python control flow on a traced shape or tensor"
    where = file_line(exc, path)
    return f"{reason} at {where}" if where else reason


def capture(
    spec: ModelSpec, *, batch_size: int = 2, method: str | None = None, leaves: tuple[str, ...] = ()
) -> Graph:
    """Trace model and loss into one graph and check that it computes the eager loss.

    ``method`` None tries torch.fx first and falls back to torch.export when fx fails, with a
    notice on the ``autopart`` logger; "fx" or "export" forces one. The graph is captured at
    ``batch_size`` samples, the microbatch size: an exported graph's shapes are fixed.
    """
    if method not in (None, "fx", "export"):
        raise ConfigError(f"unknown capture method {method!r}; use fx or export")
    inputs, target = spec.example(batch_size)
    from autopart.codegen.names import check_model_names

    check_model_names(spec.module, spec.path.name)
    _check_no_backward_hooks(spec.module, spec.path.name)
    before, versions = _built_buffers(spec.module), buffer_versions(spec.module)
    with used_functions() as used:  # the model's own autograd.Functions (`check_same_gradients`)
        loss, reduction = _eager_reference(spec, inputs, target)
    expected = None if is_meta(spec.module) else loss  # a meta model's loss has no value to compare
    leaf_types = leaf_classes(spec.module, leaves)
    _check_no_cumulative_batch_norm(spec.module, spec.path.name, leaf_types)
    if leaves and method == "export":
        raise ConfigError("--leaf keeps modules opaque to torch.fx, which torch.export cannot do; drop --capture export")
    has_target = spec.loss_fn is not None
    fx_failure = None
    if method in (None, "fx"):
        try:
            traced, callers = _trace_fx(spec, inputs, leaf_types)
            graph = _graph(traced, "fx", has_target, spec.module)
            check_fx_graph(graph.module, graph.constants, spec.module)
            check_same_loss(spec, graph.module, Example(inputs, target, has_target), expected, before, versions)
            if expected is not None:  # a meta model has no values to differentiate
                check_same_gradients(spec, graph.module, Example(inputs, target, has_target), used, callers)
            _check_takes_gradient(spec, graph, Example(inputs, target, has_target), loss)
            return replace(graph, built_buffers=before, loss_reduction=reduction)
        except ModelFileError:  # the file breaks the contract: no other capture will do better
            raise
        except Exception as exc:
            fx_failure = _reason(exc, spec.path)
            if method == "fx" or leaves:  # a refusal of the capture's own says what to change
                fixes = [] if isinstance(exc, CaptureError) else ["rewrite that code without Python control flow on tensors"]
                fixes += [] if leaves else ["use --capture export"]
                raise CaptureError(f"torch.fx could not trace {spec.path.name}: {fx_failure}"
                                   + (f"; {', or '.join(fixes)}" if fixes else "")) from None
    try:
        on_device = _on_model_device(spec, (*inputs, target) if isinstance(target, torch.Tensor) else inputs)
        module = export_training_graph(spec.module, spec.loss_fn, on_device[: len(inputs)],
                                       on_device[len(inputs)] if len(on_device) > len(inputs) else target,
                                       target_name=TARGET)
    except CaptureError:
        raise
    except Exception as exc:
        tried = f"torch.fx ({fx_failure}) nor torch.export" if fx_failure else "torch.export"
        raise CaptureError(
            f"neither {tried} could capture {spec.path.name}: {_reason(exc, spec.path)}; "
            "rewrite that code without Python control flow on tensor values"
        ) from None
    graph = _graph(_drawing_as_functions(module), "export", has_target, spec.module)
    check_inputs_unwritten(graph.module.graph)
    check_same_loss(spec, graph.module, Example(inputs, target, has_target), expected, before, versions)
    if expected is not None:
        check_same_gradients(spec, graph.module, Example(inputs, target, has_target), used, {})
    _check_takes_gradient(spec, graph, Example(inputs, target, has_target), loss)
    if fx_failure:
        log.info(f"torch.fx could not trace {spec.path.name} ({fx_failure}); captured it with torch.export")
    return replace(graph, built_buffers=before, loss_reduction=reduction)


def _check_takes_gradient(spec: ModelSpec, graph: Graph, example: Example, loss: torch.Tensor) -> None:
    """Refuse a loss that no trained parameter feeds now, before any op is timed (`autopart.passes.loss_gradient`)."""
    args = example.graph_args
    if is_meta(spec.module):
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)  # as the eager run took them
    check_loss_takes_gradient(graph.module, args, loss, spec.path.name)


_BUILT: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def _check_no_backward_hooks(model: nn.Module, file: str) -> None:
    """Refuse a backward hook on a module or a parameter: the captured graph holds the forward's
    ops, and the stages' backward is autograd's over them, which no such hook reaches (training
    would go on with other gradients than the model's, in silence)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks:
        raise CaptureError(f"{file} registers a global module backward hook, which the generated stages cannot run; "
                           "remove it, or do its work in the forward or the loss")
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            raise CaptureError(f"module '{name or 'the model'}' ({type(module).__name__}) of {file} has a backward hook, "
                               "which the generated stages cannot run (their backward is autograd's over the captured "
                               "ops); remove it, or do its work in the forward or the loss")
    for name, parameter in model.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            raise CaptureError(f"parameter '{name}' of {file} has a gradient hook (register_hook), which the generated "
                               "stages cannot run; remove it, or do its work in the forward or the loss")


def _check_no_cumulative_batch_norm(model: nn.Module, file: str, leaf_types: frozenset[type]) -> None:
    """Refuse a BatchNorm in training with ``momentum=None``: its running statistics are a
    cumulative average over ``num_batches_tracked``, a counter read as a Python number, which
    neither capture can trace (both said 'control flow on tensor values' at the line that calls
    it, which has none). Whole under ``--leaf``, it runs its own forward and counts."""
    batch_norm = nn.modules.batchnorm._BatchNorm  # BatchNorm1d/2d/3d, SyncBatchNorm and the lazy ones
    whole: list[str] = []  # the paths of the --leaf modules, whose insides are not traced
    for name, module in model.named_modules():
        if isinstance(module, tuple(leaf_types)):
            whole.append(name)
        inside = any(name == path or name.startswith(f"{path}.") for path in whole)
        if (isinstance(module, batch_norm) and module.training and module.track_running_stats
                and module.momentum is None and not inside):
            raise CaptureError(
                f"module '{name}' ({type(module).__name__}) of {file} has momentum=None, a cumulative average of its "
                "statistics by a count of batches, which the capture cannot trace; give it a momentum (0.1 is "
                f"BatchNorm's default), or keep it whole with --leaf {type(module).__name__}"
            )


def _built_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s buffers as they were when it was first captured: a model captured again (another
    tensor-parallel degree in a search) has had forwards run on it since."""
    if model not in _BUILT:
        _BUILT[model] = {name: b.clone() for name, b in model.named_buffers() if not b.is_meta}
    return _BUILT[model]


def _graph(module: fx.GraphModule, method: str, has_target: bool, model: nn.Module) -> Graph:
    names = tuple(n.name for n in module.graph.nodes if n.op == "placeholder")
    own = {n for n, _ in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))}
    constants = tuple(
        dict.fromkeys(str(n.target) for n in module.graph.nodes if n.op == "get_attr" and str(n.target) not in own)
    )
    return Graph(module=module, method=method, input_names=names, has_target=has_target, constants=constants)


_DRAWING_FUNCTIONS = {  # an exported graph's ops that draw, and the torch functions of the same signature
    torch.ops.aten.dropout.default: F.dropout,
    torch.ops.aten.dropout_.default: torch.dropout_,
    torch.ops.aten.feature_dropout.default: torch.feature_dropout,
    torch.ops.aten.feature_dropout_.default: torch.feature_dropout_,
    torch.ops.aten.alpha_dropout.default: torch.alpha_dropout,
    torch.ops.aten.alpha_dropout_.default: torch.alpha_dropout_,
    torch.ops.aten.feature_alpha_dropout.default: torch.feature_alpha_dropout,
    torch.ops.aten.feature_alpha_dropout_.default: torch.feature_alpha_dropout_,
    torch.ops.aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
}


def _drawing_as_functions(module: fx.GraphModule) -> fx.GraphModule:
    """An exported graph's dropouts and attention as the torch functions that fx graphs call: the
    runtime turns dropout off (`autopart.runtime.forward.NoDropout`) and gives a split tensor's
    draws a stream per rank (`autopart.codegen.tensor_parallel`) by those functions."""
    drawing = [n for n in module.graph.nodes if n.op == "call_function" and n.target in _DRAWING_FUNCTIONS]
    for node in drawing:
        node.target = _DRAWING_FUNCTIONS[node.target]
        if node.target is F.scaled_dot_product_attention:  # by name past the values, as fx graphs have them
            node.kwargs = {**dict(zip(("attn_mask", "dropout_p", "is_causal"), node.args[3:])), **node.kwargs}
            node.args = node.args[:3]
    if drawing:
        module.recompile()
    return module


def _on_model_device(spec: ModelSpec, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(x.to("meta") for x in inputs) if is_meta(spec.module) else inputs


def _eager_reference(spec: ModelSpec, inputs: tuple[torch.Tensor, ...], target: Any) -> tuple[torch.Tensor, str]:
    """The eager loss that the graph must match (on the meta device only its dtype is known), and
    how the loss reduces over the batch (`autopart.passes.loss_reduction.reduction_of`).

    A meta model with a long run of layers alike is run with two of them (``autopart.passes.shallow``):
    the layers past the second take what the second gives, of the same shapes, so the check
    says the same, and running a thousand layers on the meta device takes minutes."""
    meta = is_meta(spec.module)
    checked = spec
    if meta:
        layers = repeated_layers(spec.module)
        if layers is not None:
            checked = replace(spec, module=shallow_module(spec.module, layers))
    reduction = UNKNOWN
    with torch.no_grad(), torch.device("meta") if meta else contextlib.nullcontext(), same_draws():
        try:
            args = _on_model_device(spec, inputs), target.to("meta") if meta and target is not None else target
            output = checked.module(*args[0])
        except Exception as exc:
            raise ModelFileError(
                f"the model rejects its own example batch: {describe_error(exc, spec.path)}; "
                "make example_batch() match the model's forward"
            ) from None
        expected = output if spec.loss_fn is None else _loss_of(spec, output, args[1])
        if not meta and spec.loss_fn is not None:  # the output kept to tell how the loss reduces over the batch
            reduction = _loss_of(spec, output, args[1], lambda: reduction_of(spec.loss_fn, output, args[1]))
    if not isinstance(expected, torch.Tensor) or expected.numel() != 1:
        raise ModelFileError(
            f"the loss of {spec.path.name} is not a scalar tensor; define loss_fn(output, target) "
            "that returns the mean loss, or make the model return it"
        )
    if not meta and not bool(torch.isfinite(expected)):  # the graph's check would compare nan with nan
        raise ModelFileError(
            f"the loss of {spec.path.name} on example_batch() is {expected.item()} with the weights build_model() "
            "gives: its forward or loss_fn computes a value that is not finite (a log or a division by 0, a "
            "parameter left uninitialised); fix the model so that its loss is finite, and compile again"
        )
    return expected, reduction


def _loss_of(spec: ModelSpec, output: Any, target: Any, run: Callable[[], Any] | None = None) -> Any:
    """``loss_fn(output, target)`` (or ``run()``, which calls it), a failure of it named as its own:
    the example batch went through the model's forward, which is not what went wrong."""
    try:
        return run() if run is not None else spec.loss_fn(output, target)
    except Exception as exc:
        given = "" if isinstance(output, torch.Tensor) else \
            f", given the {type(output).__name__} that the model's forward returns"
        raise ModelFileError(
            f"loss_fn(output, target) in {spec.path.name} raised {describe_error(exc, spec.path)}{given}; fix loss_fn "
            "so that it takes the model's output and the target and returns the mean loss"
        ) from None


def graph_args(graph: Graph, inputs: tuple[torch.Tensor, ...], target: Any) -> tuple[Any, ...]:
    return (*inputs, target) if graph.has_target else tuple(inputs)
