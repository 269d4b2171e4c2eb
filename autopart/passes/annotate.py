"""Annotate every node of the training graph with its shapes and its costs.

``annotate(graph, spec, cost_model, micro_batch_size=b) -> OpGraph`` runs the graph once on the
example batch at the microbatch size and records, per node:

- the shapes and dtypes of what it produces;
- the kernels it runs in forward and in backward (split into the input-gradient and the
  weight-gradient halves, which zero-bubble schedules run apart), their FLOPs, and their times
  from the cost model;
- the bytes that autograd saves for backward, measured with saved-tensor hooks on a run of the
  whole graph (a storage saved by two nodes counts once), and the bytes of the outputs that
  selective recompute keeps (`autopart.passes.recompute.keeps_output`), measured on the same run;
- whether its value needs a gradient (a trainable parameter upstream, `autopart.passes.grad_flow`):
  an op whose inputs need none has no input-gradient half, and one that needs none no backward;
- whether it reads a parameter, and whether it depends only on the batch and on buffers
  ("batch-derived": position ids, masks, reshaped targets), which later passes recompute on
  every stage that needs them instead of sending them through the pipeline.

With ``dtype`` a bf16 precision every forward runs under ``torch.autocast(bfloat16)``, as the
runtime runs it: output dtypes, kernels (so the roofline's 16-bit rate), saved bytes (16-bit
activations) all follow. Under ``bf16-autocast`` the weights are fp32, so each forward has
autocast's casts of them and matrix products save 16-bit copies of them per microbatch; under
``bf16`` the nodes read bf16 working copies, as the runtime's stages do (`autopart.runtime.forward`):
no cast in the forward, nothing saved for a weight but the copy every microbatch shares, and in
backward each weight gradient is cast back to the fp32 master's dtype. The autocast is the
target device's: CPU's for ``cpu``, CUDA's casts (``autopart.passes.autocast_lists``) for a GPU spec,
whose op lists differ from CPU's (CUDA runs ``pow``, ``rsqrt``, softmax and the losses in fp32).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopart.ir.tensors import DTYPES, TensorMeta, autocast_dtype, precision, tensor_meta, working_dtype
from autopart.passes.autocast_lists import cuda_autocast
from autopart.passes.buffer_writes import check_buffers_hold_no_graph, writes_in_place, written_in_forward
from autopart.passes.cost_keys import cost_key
from autopart.passes.kernel_figures import kernel_figures, recompute_share
from autopart.passes.grad_flow import GradientFlow, needed_backward, took_gradient, trainable_parameters
from autopart.passes.grad_leaves import grad_ready, leaves_for_grad
from autopart.passes.loss_gradient import no_gradient_error
from autopart.passes.weight_seeds import OpSeeds, ParameterValues, arg_nodes, arg_places, op_seeds, shared_seeds
from autopart.ir.errors import PrecisionError
from autopart.ir.model_file import ModelSpec, is_meta
from autopart.passes.capture import Graph, graph_args
from autopart.ir.recompute import dropout_mask_bytes, keeps_output
from cost_models import CostModel, Kernel, KernelRecorder

__all__ = ["mixed_dtype_error", "module_path", "NodeCost", "OpGraph", "annotate", "target_precision"]

def target_precision(dtype: str, device_kind: str) -> contextlib.AbstractContextManager:
    """The autocast a device of ``device_kind`` runs the forward in, applied on this machine's
    tensors: CPU's own, or CUDA's casts (``autopart.passes.autocast_lists``) whatever machine compiles."""
    lower = autocast_dtype(dtype)
    if lower is not None and device_kind in ("cuda", "rocm"):  # ROCm's torch autocasts as "cuda"
        return cuda_autocast(lower)
    return precision(dtype)


@dataclass(frozen=True, kw_only=True)
class NodeCost:
    """What one fx node produces and what it costs, at the annotated microbatch size."""

    name: str
    op: str  # fx op: placeholder, get_attr, call_function, call_method, output
    output: TensorMeta | None  # None when the node produces something other than one tensor
    forward_flops: float = 0.0
    backward_flops: float = 0.0  # model FLOPs, without a fused attention's recompute (`kernel_figures`)
    forward_s: float = 0.0
    backward_input_s: float = 0.0  # gradients of the node's inputs
    backward_weight_s: float = 0.0  # gradients of the parameters the node reads
    saved_bytes: int = 0
    selective_saved_bytes: int = 0  # outputs of its ops that selective recompute keeps (matmuls, attention)
    selective_recompute_s: float = 0.0  # forward seconds of its other ops, which selective recompute runs again
    weight_seed_bytes: int = 0  # what a split backward keeps from I to W (`autopart.passes.weight_seeds`)
    weight_seed_reader: str = ""  # the one reader that keeps the same gradient (`weight_seeds.shared_seeds`)
    parameter_bytes: int = 0  # for a get_attr of a parameter
    is_parameter: bool = False
    is_buffer: bool = False
    batch_derived: bool = False
    needs_grad: bool = False  # a trainable parameter upstream (`autopart.passes.grad_flow`): else no backward
    module_path: str = ""
    constant: Any = None  # the value, for a node that computes a Python number or a shape


    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True, kw_only=True)
class OpGraph:
    graph: Graph
    nodes: dict[str, NodeCost]  # in the graph's topological order
    micro_batch_size: int
    cost_model: str
    dtype: str = "fp32"  # the precision it was annotated in (DTYPES)
    kernels: dict[str, tuple[tuple[Kernel, ...], ...]] = field(default_factory=dict, repr=False)
    """Per op node, its kernels: forward, input gradients, weight gradients."""
    leaf_tensors: dict[str, dict[str, TensorMeta]] = field(default_factory=dict)
    """Per call_module node (a ``--leaf`` module): its parameters and buffers, by full name."""

    def leaf_parameters(self, node: str) -> tuple[str, ...]:
        """The parameters that a leaf module's node reads; () for any other node."""
        if node not in self.leaf_tensors:  # most nodes: no need to list the module's parameters
            return ()
        state = dict(self.graph.module.named_parameters(remove_duplicate=False))
        return tuple(name for name in self.leaf_tensors.get(node, {}) if name in state)

    def fx_nodes(self) -> list[fx.Node]:
        return list(self.graph.module.graph.nodes)


def module_path(node: fx.Node) -> str:
    """The module the node was traced in (``h.3.attn``); "" for the model's own forward."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return next(reversed(stack.values()))[0]


class _State:
    """The graph's parameters and buffers by name: the real tensors, or for a model built on the
    meta device, fake tensors of the same shapes that allocate nothing."""

    def __init__(self, module: fx.GraphModule, fake: bool, dtype: str = "fp32", device_kind: str = "cpu"):
        self.dtype = dtype
        self.device_kind = device_kind
        self.parameters = dict(module.named_parameters(remove_duplicate=False))
        self.tensors: dict[str, torch.Tensor] = {**self.parameters, **dict(module.named_buffers(remove_duplicate=False))}
        self.root = module
        if fake:
            made: dict[int, torch.Tensor] = {}  # tied tensors stay one tensor
            for name, t in self.tensors.items():
                if id(t) not in made:
                    made[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                    made[id(t)].requires_grad_(t.requires_grad)  # what autograd saves depends on it
                self.tensors[name] = made[id(t)]
        self.master = None  # the master weights' dtype where forwards use working copies of another
        lower = working_dtype(dtype)
        if lower is not None:  # bf16: forward and backward see the working copies, as the runtime's do
            self.master = torch.float32
            cast: dict[int, torch.Tensor] = {}
            for name in self.parameters:
                t = self.tensors[name]
                if t.is_floating_point() and id(t) not in cast:
                    cast[id(t)] = t.detach().to(lower).requires_grad_(t.requires_grad)
                self.tensors[name] = cast.get(id(t), t)
        self.parameter_ids = {id(self.tensors[name]) for name in self.parameters}
        self.frozen_ids = {id(self.tensors[name]) for name, p in self.parameters.items() if not p.requires_grad}

    def precision(self) -> contextlib.AbstractContextManager:
        return target_precision(self.dtype, self.device_kind)

    def held(self, value: torch.Tensor) -> TensorMeta:
        """A parameter as the rank holds it: under ``bf16`` the fp32 master that its working copy
        is cast from (what the stage declares, the optimizer steps and gradients sum in)."""
        meta = tensor_meta(value)
        if self.master is not None and value.is_floating_point():
            return TensorMeta(shape=meta.shape, dtype=str(self.master).removeprefix("torch."))
        return meta

    def attr(self, target: str) -> Any:
        return self.tensors[target] if target in self.tensors else _fetch_attr(self.root, target)

    def leaf_state(self, target: str) -> dict[str, torch.Tensor]:
        prefix = f"{target}."
        return {name.removeprefix(prefix): t for name, t in self.tensors.items() if name.startswith(prefix)}

    def call_leaf(self, target: str, args: tuple, kwargs: dict, state: dict[str, torch.Tensor] | None = None) -> Any:
        module = self.root.get_submodule(target)
        return torch.func.functional_call(module, state or self.leaf_state(target), args, kwargs)


def mixed_dtype_error(exc: RuntimeError, op: str, dtype: str = "fp32") -> Exception:
    """``exc`` as the one line a user can act on when it is the precision's doing: CPU autocast's
    refusal to mix a bf16 working weight with fp32 values (it runs norms in their input's dtype,
    CUDA's in fp32), or an op that refuses operands of two dtypes, which autocast makes where the
    model mixes ops it casts differently (a ``scatter`` of a softmax, which CUDA's runs in fp32,
    into a matmul's bf16 output); ``exc`` itself otherwise."""
    if "mixed dtype (CPU)" in str(exc) and dtype != "fp32":
        return PrecisionError(f"on the CPU, autocast runs norms in their input's dtype and this model meets a bf16 "
                           f"working weight with fp32 values at '{op}'; compile with --dtype bf16-autocast (fp32 "
                           "weights) for the CPU")  # fmt: skip
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if dtype != "fp32" and ("dtype" in message or "scalar type" in message):
        return PrecisionError(f"under --dtype {dtype} this model's op '{op}' fails on the dtypes autocast gives its "
                           f"operands ({message}); cast them to one dtype in the model (as torch.autocast on the "
                           "device would need too), or compile with --dtype fp32")  # fmt: skip
    return exc


def run_one(node: fx.Node, args: tuple, kwargs: dict, state: _State | None = None) -> Any:
    """Run one node on concrete arguments (``state`` holds the weights of ``--leaf`` modules)."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    if node.op == "call_module":
        assert state is not None, "a leaf module runs with the weights of its state"
        return state.call_leaf(str(node.target), args, kwargs)
    raise AssertionError(f"unexpected node {node.op}")


def _measure_kernels(
    node: fx.Node, args: tuple, kwargs: dict, state: _State, arg_values: list, made_from_weights: tuple[int, ...]
) -> tuple[list[Kernel], list[Kernel], list[Kernel], OpSeeds]:
    """Kernels of the node's forward, of its input gradients and of its weight gradients, and
    what a split backward keeps from its I to its W (`autopart.passes.weight_seeds.op_seeds`)."""
    parameters = state.parameter_ids
    originals = pytree.tree_leaves((args, kwargs))
    # an in-place op runs on copies: on the values themselves it would write them again, under the
    # nodes that read them next (T5's relative-position buckets, ``+=`` twice, index past its table)
    args, kwargs, inputs, weights = leaves_for_grad(args, kwargs, parameters, clone=writes_in_place(node),
                                                    master=state.master, frozen=state.frozen_ids)
    original_of = {id(leaf): value for value, leaf in zip(originals, pytree.tree_leaves((args, kwargs)))}
    with KernelRecorder() as forward, state.precision():  # backward runs outside autocast, as in training
        try:
            if node.op == "call_module":  # a leaf module: its own weights are the node's weights
                own = {
                    k: grad_ready(v, parameters, inputs, weights, state.master)
                    if id(v) in parameters and id(v) not in state.frozen_ids else v
                    for k, v in state.leaf_state(str(node.target)).items()
                }
                out = state.call_leaf(str(node.target), args, kwargs, own)
            else:
                out = run_one(node, args, kwargs, state)
        except RuntimeError:  # an in-place op on a leaf: count it without autograd
            with torch.no_grad():
                out = run_one(node, args, kwargs, state)
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = [torch.ones_like(t) for t in outputs]
    input_kernels: list[Kernel] = []
    weight_kernels: list[Kernel] = []
    input_grads: dict[int, torch.Tensor | None] = {}
    for wrt, sink in ((inputs, input_kernels), (weights, weight_kernels)):
        if outputs and wrt:
            with KernelRecorder() as backward:
                found = torch.autograd.grad(outputs, wrt, grads, retain_graph=True, allow_unused=True)
            sink.extend(backward.kernels)
            if wrt is inputs:
                input_grads = {id(original_of.get(id(leaf))): g for leaf, g in zip(inputs, found)}
    seeds = op_seeds(outputs, grads, inputs, weights, input_grads, original_of, arg_values, made_from_weights)
    return forward.kernels, input_kernels, weight_kernels, seeds


class _KeptOutputs(TorchDispatchMode):
    """Charges the outputs of the ops that selective recompute keeps to the node that runs them."""

    def __init__(self, owner: _SavedBytes):
        super().__init__()
        self.owner = owner
        self.held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if keeps_output(func):
            for tensor in pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self.owner.charge(self.owner.kept, tensor, self.owner.kept_seen)
                    self.held.append(tensor)  # as the checkpoint holds it: its storage's address stays its own
        return out


class _SavedBytes(fx.Interpreter):
    """Runs the whole graph once, charging each tensor saved for backward to the node that saved it,
    and each output that selective recompute would keep to the node that made it."""

    def __init__(self, module: fx.GraphModule, state: _State):
        super().__init__(module)
        self.state = state
        self.current, self.current_target = "", None
        # storages are told apart by their StorageImpl, which fake and meta tensors have too
        self.seen = {t.untyped_storage()._cdata for t in state.tensors.values()}
        self.saved: dict[str, int] = {}
        self.kept: dict[str, int] = {}
        self.kept_seen: set[int] = set()
        self.values: dict[str, Any] = {}  # each node's output: annotate reads its shapes from this run

    def fetch_attr(self, target: str) -> Any:
        return self.state.attr(target)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self.state.call_leaf(str(target), args, kwargs)

    def charge(self, into: dict[str, int], tensor: torch.Tensor, seen: set[int], nbytes: int | None = None) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in seen:
            seen.add(key)
            into[self.current] = into.get(self.current, 0) + (storage.nbytes() if nbytes is None else nbytes)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.charge(self.saved, tensor, self.seen, dropout_mask_bytes(self.current_target, tensor, self.state.device_kind))
        return tensor

    def run_node(self, node: fx.Node) -> Any:
        self.current, self.current_target = node.name, node.target
        value = self.values[node.name] = super().run_node(node)
        return value

    def measure(self, *args: Any) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes saved for backward, and bytes that selective recompute keeps, per node."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t), self.state.precision():
            with _KeptOutputs(self):
                self.run(*args)
        return self.saved, self.kept


def _batch_derived(node: fx.Node, derived: dict[str, bool], parameter_names: set[str], written: set[str]) -> bool:
    if node.op == "placeholder":
        return True
    if node.op == "get_attr":
        return node.target not in parameter_names
    if node.op in ("output", "call_module"):  # a leaf module holds weights
        return False
    if not node.users and writes_in_place(node):  # run for its effect (a buffer's update): by one stage, not by none
        return False
    if node.name in written:  # made again elsewhere, it would miss its writes: sent, as computed values are
        return False
    inputs = node.all_input_nodes
    return all(derived[n.name] for n in inputs)


def annotate(
    graph: Graph, spec: ModelSpec, cost_model: CostModel, *, micro_batch_size: int, dtype: str = "fp32",
    measured: dict[tuple, tuple] | None = None,
) -> OpGraph:
    """Shapes, kernels, times and saved bytes of every node at ``micro_batch_size``, in ``dtype``.

    A model built on the meta device runs on fake tensors: shapes, kernels and saved bytes come
    out the same, and nothing is allocated. ``measured``: the kernels, times and seeds of ops by
    cost key (and what their seeds depend on besides), from earlier calls with the same cost model,
    used and added to (ops that several captures share, such as one model's at two
    tensor-parallel degrees, are measured once).
    """
    assert dtype in DTYPES, dtype
    module = graph.module
    inputs, target = spec.example(micro_batch_size)
    fake = is_meta(module)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        state = _State(module, fake, dtype, cost_model.device.kind)
        run = _SavedBytes(module, state)
        try:
            saved, kept = run.measure(*graph_args(graph, inputs, target))
        except RuntimeError as exc:
            raise mixed_dtype_error(exc, run.current, dtype) from None
        check_buffers_hold_no_graph(module)
        nodes, kernels, leaves = _annotate_nodes(
            graph, state, (saved, kept), cost_model, graph_args(graph, inputs, target),
            {} if measured is None else measured, run.values,
        )
    loss = next(node for node in reversed(module.graph.nodes) if node.op == "output")
    if not nodes[loss.name].needs_grad:  # what the capture's rule passed (an integer made midway): the values tell
        raise no_gradient_error(spec.path.name)
    return OpGraph(
        graph=graph,
        nodes=nodes,
        micro_batch_size=micro_batch_size,
        cost_model=cost_model.name,
        dtype=dtype,
        kernels=kernels,
        leaf_tensors=leaves,
    )


def _annotate_nodes(
    graph: Graph,
    state: _State,
    measured: tuple[dict[str, int], dict[str, int]],
    cost_model: CostModel,
    feed_values: tuple,
    measured_by_key: dict[tuple, tuple],
    ran: dict[str, Any],
):
    saved, kept = measured
    values: dict[str, Any] = {}
    derived: dict[str, bool] = {}
    nodes: dict[str, NodeCost] = {}
    kernels: dict[str, tuple[tuple[Kernel, ...], ...]] = {}
    leaves: dict[str, dict[str, TensorMeta]] = {}
    measured_seeds: dict[str, OpSeeds] = {}
    feed = iter(feed_values)
    parameter_names = set(state.parameters)
    from_parameters = ParameterValues(parameter_names)
    flow = GradientFlow(trainable_parameters(graph.module), took_gradient(ran))
    written = written_in_forward(graph.module.graph)
    for node in graph.module.graph.nodes:
        derived[node.name] = _batch_derived(node, derived, parameter_names, written)
        seed_key = from_parameters.visit(node, ran.get(node.name)), arg_places(node)  # beside its cost key
        needs = flow.visit(node, ran.get(node.name))
        common = dict(name=node.name, op=node.op, module_path=module_path(node), batch_derived=derived[node.name],
                      needs_grad=needs)
        if node.op == "placeholder":
            value = next(feed)
            values[node.name] = value
            nodes[node.name] = NodeCost(output=_meta(value), **common)
            continue
        if node.op == "get_attr":
            values[node.name], nodes[node.name] = _attribute(node, state, common)
            continue
        if node.op == "output":
            nodes[node.name] = NodeCost(output=None, **common)
            continue
        args, kwargs = pytree.tree_map(
            lambda a: values[a.name] if isinstance(a, fx.Node) else a, (node.args, node.kwargs)
        )
        value = values[node.name] = ran[node.name]  # as the run that measured saved bytes made it
        key = cost_key(node, args, kwargs, state.parameter_ids, state.dtype, state.frozen_ids)
        # the key holds all that the kernels depend on (op, shapes, dtypes, roles): a repeated
        # layer's nodes are measured once, the rest take the first's kernels (a leaf module's
        # key names the module, so it is never shared)
        if (key, seed_key) not in measured_by_key:
            forward, backward_input, backward_weight, seeds = _measure_kernels(
                node, args, kwargs, state, [values[n.name] for n in arg_nodes(node)], seed_key[0])
            measured_by_key[key, seed_key] = (forward, backward_input, backward_weight,
                                              cost_model.op_times(key, forward, backward_input, backward_weight),
                                              recompute_share(forward, cost_model), seeds)
        forward, backward_input, backward_weight, times, share, seeds = measured_by_key[key, seed_key]
        (backward_input, backward_weight), times, seeds = needed_backward(  # what training runs of it
            (backward_input, backward_weight), times, seeds, input_gradient=flow.input_gradient(node, parameter_names),
            needs=needs)
        kernels[node.name] = (tuple(forward), tuple(backward_input), tuple(backward_weight))
        parameter_bytes = 0
        if node.op == "call_module":
            own = {f"{node.target}.{k}": v for k, v in state.leaf_state(str(node.target)).items()}
            leaves[node.name] = {k: state.held(v) if k in state.parameters else tensor_meta(v) for k, v in own.items()}
            parameter_bytes = sum(leaves[node.name][k].nbytes for k in own if k in state.parameters)
        nodes[node.name] = NodeCost(
            output=_meta(value),
            constant=_constant(value),
            saved_bytes=saved.get(node.name, 0) if needs else 0,  # kept for no backward
            selective_saved_bytes=kept.get(node.name, 0) if needs else 0,
            weight_seed_bytes=seeds.nbytes,
            parameter_bytes=parameter_bytes,
            **kernel_figures(kernels[node.name], times, share if needs else 0.0),  # no backward to recompute for
            **common,
        )
        measured_seeds[node.name] = seeds
    for name, reader in shared_seeds(graph.module.graph, measured_seeds).items():
        nodes[name] = replace(nodes[name], weight_seed_reader=reader)
    for name in (name for name, needs in flow.needs.items() if needs and not nodes[name].needs_grad):
        nodes[name] = replace(nodes[name], needs_grad=True)  # written in place later with what needs one
    return nodes, kernels, leaves


def _attribute(node: fx.Node, state: _State, common: dict[str, Any]) -> tuple[Any, NodeCost]:
    """A ``get_attr`` node's value and its annotation: a parameter as the rank holds it, or a buffer."""
    value = state.attr(str(node.target))
    is_parameter = node.target in state.parameters
    output = state.held(value) if is_parameter else _meta(value)
    return value, NodeCost(output=output, is_parameter=is_parameter, parameter_bytes=output.nbytes if is_parameter else 0,
                           is_buffer=not is_parameter and isinstance(value, torch.Tensor), **common)


def _constant(value: Any) -> Any:
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (tuple, list, torch.Size)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def _meta(value: Any) -> TensorMeta | None:
    return tensor_meta(value) if isinstance(value, torch.Tensor) else None


def _fetch_attr(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value

