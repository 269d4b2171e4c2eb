"""The search's costs from real captures of the model: ``FrontTable``, a ``CostTable``
(``autopart.solve.search``) that captures the model once and annotates it per micro-batch size
(the graph's shapes depend on it; most sizes are read off a line through two:
``autopart.passes.scale``; a deep model's annotation off a shallow copy's:
``autopart.passes.repeat_annotation``) and shards it per tensor-parallel degree
(``autopart.solve.tensor``), each made once, when the search first asks. Its optimistic costs
(``autopart.solve.layout_bounds``) need no sharding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autopart.codegen.layers import layer_instances
from autopart.ir.errors import AutopartError
from autopart.ir.model_file import ModelSpec, is_meta, load_model_file
from autopart.options import CompileOptions
from autopart.passes.capture import Graph
from autopart.passes.blocks import build_blocks
from autopart.passes.front import (
    Front, annotated, block_seconds, block_weight_seeds, boundary_gathered_bytes, boundary_gradients, boundary_held_bytes,
    capture_for, loss_working_bytes, parameter_placements, sharded,
)
from autopart.passes.repeat_annotation import laid_out
from autopart.passes.scale import SizeLines
from autopart.predict.memory import owned_bytes, state_bytes
from autopart.runtime.materialise import check_buffers_made, check_initialisers
from autopart.runtime.recipe import decayed_parameters
from autopart.solve.assemble import layered_parameters
from autopart.solve.chain_costs import ChainCosts
from autopart.solve.layout_bounds import optimistic_costs
from autopart.solve.sharding import REPLICATE
from autopart.solve.tensor import fastest_compute_s

__all__ = ["FrontTable", "Progress", "chain_costs", "sequence_parallel"]

Progress = Callable[[str, int, int], None]  # (what, done, total)


class FrontTable:
    """The search's ``CostTable`` over real captures of the model, each made once."""

    def __init__(self, options: CompileOptions, progress: Progress | None = None, spec: ModelSpec | None = None,
                 largest_size: int | None = None):
        """``largest_size``: the largest micro-batch size the caller will ask costs at, where known."""
        self.options = options
        self.largest_size = largest_size
        self.progress = progress
        self.annotated: dict[tuple[int, bool, str], Front] = {}
        self._fronts: dict[tuple[int, int, str], Front] = {}
        self._costs: dict[tuple[int, int, str], ChainCosts] = {}
        self._optimistic: dict[tuple[int, int, str], ChainCosts] = {}
        self._spec = spec
        self._roofline = None
        self._measured: dict[tuple, tuple] = {}  # ops' kernels, times and seeds by cost key, for every capture
        self._graphs: dict[bool, Graph] = {}  # the capture, by whether biases are ops of their own
        self._lines = SizeLines(largest_size)  # annotations at most sizes read off a line through two
        self._exact: dict[tuple[int, bool, str], Front] = {}  # real annotations the lines did not make
        self._copy: tuple[FrontTable, str] | None = None  # a shallow copy's table and its layers' path
        self._not_alike: set[tuple[bool, str]] = set()  # forms whose capture the copy's did not lay out

    def lay_out_from(self, shallow: FrontTable, layers_path: str) -> None:
        """Read each annotation off ``shallow``'s (this model with the first ``LAID_OUT_FROM`` of
        the layers at ``layers_path``) where the captures are alike
        (``autopart.passes.repeat_annotation``)."""
        self._copy = (shallow, layers_path)

    def model_spec(self) -> ModelSpec:
        """The model file, loaded (and its initialisers checked) once."""
        if self._spec is None:
            spec = load_model_file(self.options.model)
            if is_meta(spec.module):  # each rank will make its own weights: every module needs an initialiser
                check_initialisers(spec.module, spec.init_weights, spec.path.name)
                check_buffers_made(spec.module, spec.init_weights)
            self._spec = spec
        return self._spec

    def front(self, *, micro_batch_size: int, tp: int, dtype: str) -> Front:
        key = (micro_batch_size, tp, dtype)
        if key not in self._fronts:
            base = self.annotated_front(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)
            self._fronts[key] = sharded(base, self._options(tp=tp, dtype=dtype))
        return self._fronts[key]

    def annotated_front(self, *, micro_batch_size: int, tp: int, dtype: str) -> Front:
        """The capture annotated at this size, not yet sharded: one per size, dtype and bias form."""
        base_key = (micro_batch_size, tp > 1, dtype)
        if base_key not in self.annotated:
            def real(size: int) -> Front:
                return self._annotate(size, tp=tp, dtype=dtype)

            # a roofline costs a kernel from its FLOPs and bytes, which a line through two sizes
            # gives (``autopart.passes.scale``); measured ops are keyed by their shapes
            self.annotated[base_key] = (real(micro_batch_size) if self.options.costs is not None
                                        else self._lines.front(micro_batch_size, base_key[1:], real))
        return self.annotated[base_key]

    def exact_front(self, *, micro_batch_size: int, tp: int, dtype: str) -> Front:
        """``annotated_front`` as annotated at this very size, never read off a line."""
        key = (micro_batch_size, tp > 1, dtype)
        found = self._lines.real(micro_batch_size, key[1:])
        if found is None:
            if key not in self._exact:
                self._exact[key] = self._annotate(micro_batch_size, tp=tp, dtype=dtype)
            found = self._exact[key]
        return found

    def _annotate(self, size: int, *, tp: int, dtype: str) -> Front:
        """A real annotation at ``size``: read off the shallow copy's where that is alike, else made."""
        separate = tp > 1
        self._capturing(size)
        options = self._options(tp=tp, dtype=dtype)
        if self._copy is not None and self.options.costs is None:
            front = self._laid_out(options, size)
            if front is not None:
                return front
        front = annotated(options, size, separate_biases=separate, spec=self.model_spec(), roofline=self._roofline,
                          measured=self._measured, graph=self._graphs.get(separate), ranks_from=self.options)
        self._graphs[separate] = front.op_graph.graph  # captured once, annotated at each size
        self._roofline = getattr(front.cost_model, "roofline", front.cost_model)
        return front

    def capture_method(self, *, tp: int) -> str | None:
        """How the model was captured in ``tp``'s form (biases apart where ``tp`` > 1): "fx" or
        "export"; None where it has not been."""
        graph = self._graphs.get(tp > 1)
        return graph.method if graph is not None else None

    def capture_ahead(self, *, micro_batch_size: int, tp: int) -> None:
        """The model's fx capture for ``tp`` made now, for the annotation at any size that will
        read it (`_annotate`): a caller whose workers are busy meanwhile (scoring the search's
        finalists) takes the capture of a thousand layers off the path after them. Left to that
        path where torch.fx is not to be used, or fails: there it falls back or says why."""
        separate = tp > 1
        if separate in self._graphs or self.options.capture == "export":
            return
        self._capturing(micro_batch_size)
        try:
            self._graphs[separate] = capture_for(self.model_spec(), tp, batch_size=micro_batch_size, method="fx",
                                                 leaves=self.options.leaf)
        except AutopartError:
            pass

    def _capturing(self, size: int) -> None:
        if self.progress is not None:
            self.progress(f"capturing at micro-batch size {size}", len(self.annotated), 0)

    def _laid_out(self, options: CompileOptions, size: int) -> Front | None:
        separate = options.tp > 1
        if (separate, options.dtype) in self._not_alike:
            return None
        shallow, layers_path = self._copy
        copy = shallow.exact_front(micro_batch_size=size, tp=options.tp, dtype=options.dtype)
        if copy.op_graph.graph.method != "fx":  # an exported graph holds its batch size and names its weights apart
            self._not_alike.add((separate, options.dtype))
            return None
        if separate not in self._graphs:
            self._graphs[separate] = capture_for(self.model_spec(), options.tp, batch_size=size,
                                                 method=options.capture, leaves=options.leaf)
        op_graph = laid_out(self._graphs[separate], copy.op_graph, layers_path)
        if op_graph is None:  # the same at every size: the graphs hold no batch size
            self._not_alike.add((separate, options.dtype))
            return None
        self._roofline = getattr(copy.cost_model, "roofline", copy.cost_model)
        return Front(spec=self.model_spec(), op_graph=op_graph, chain=build_blocks(op_graph),
                     cost_model=copy.cost_model)

    def optimistic_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        """Costs that no sharding on ``tp`` ranks beats, block by block and parameter by parameter
        (``autopart.solve.layout_bounds``), from the annotated capture without solving a sharding."""
        if tp == 1:
            return self.chain_costs(micro_batch_size=micro_batch_size, tp=1, dtype=dtype)
        key = (micro_batch_size, tp, dtype)
        if key not in self._optimistic:
            front = self.annotated_front(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)
            floors = fastest_compute_s(front.chain, t=tp, cost_model=front.cost_model)
            self._optimistic[key] = optimistic_costs(chain_costs(front, 1), floors, tp)
        return self._optimistic[key]

    def _options(self, *, tp: int, dtype: str) -> CompileOptions:
        return replace(self.options, world_size=None, run_finalists=None, tp=tp, pp=1, dp=1, zero=0, schedule="1f1b",
                       chunks=1, recompute="none", dtype=dtype, sp=sequence_parallel(self.options))

    def chain_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        key = (micro_batch_size, tp, dtype)
        if key not in self._costs:
            self._costs[key] = chain_costs(self.front(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype), tp)
        return self._costs[key]

    def state_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32", layered: bool = False,
                    frozen: bool = False) -> int:
        return state_bytes(parameter_bytes, optimizer=self.options.optimizer, dp=dp, zero=zero, dtype=dtype,
                           layered=layered, frozen=frozen)

    def owned_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32",
                    frozen: bool = False) -> int:
        return owned_bytes(parameter_bytes, optimizer=self.options.optimizer, dp=dp, zero=zero, dtype=dtype,
                           frozen=frozen)


def chain_costs(front: Front, tp: int) -> ChainCosts:
    """What the cutter reads, per block, from an annotated (and sharded) front."""
    chain = front.chain
    times = block_seconds(front)
    if front.shardings is not None:
        saved = [s.saved_bytes for s in front.shardings]
    else:
        saved = [b.saved_bytes for b in chain.blocks]
    selective_saved, selective_s = [], []
    for k, block in enumerate(chain.blocks):  # the tensor-parallel share, as the compiler takes it
        scale = saved[k] / block.saved_bytes if block.saved_bytes else 1.0
        time_scale = times[k][0] / block.forward_s if block.forward_s else 1.0
        selective_saved.append(round(block.selective_saved_bytes * scale))
        selective_s.append(block.selective_recompute_s * time_scale)
    placements = parameter_placements(front)
    local = {
        name: nbytes // (tp if placements.get(name, REPLICATE).kind == "S" else 1)
        for name, nbytes in chain.parameter_bytes.items()
    }
    layered, layer_bytes = layered_parameters(chain, local)
    op_graph = front.op_graph
    inputs = sum(op_graph.nodes[n].output.nbytes for n in op_graph.graph.input_names
                 if n in op_graph.nodes and op_graph.nodes[n].output is not None)
    return ChainCosts(
        forward_s=tuple(f for f, _, _ in times),
        backward_s=tuple(b for _, b, _ in times),
        weight_s=tuple(w for _, _, w in times),
        saved_bytes=tuple(saved),
        selective_saved_bytes=tuple(selective_saved),
        selective_recompute_s=tuple(selective_s),
        boundary_bytes=boundary_held_bytes(front, tp),
        boundary_gathered_bytes=boundary_gathered_bytes(front, tp) if tp > 1 else (),
        boundary_gradients=boundary_gradients(front),
        input_bytes=inputs,
        parameter_bytes=local,
        parameter_state_bytes=local,  # replaced per layout by the search (dp, ZeRO)
        block_parameters=tuple(b.parameters for b in chain.blocks),
        layer_parameters=layered,
        frozen_parameters=front.chain.frozen_parameters,
        layer_bytes=layer_bytes,
        layer_spans=tuple((first, end) for first, end, _ in layer_instances(chain)),
        loss_working_bytes=loss_working_bytes(front, tp),
        weight_seed_bytes=block_weight_seeds(front),
        decayed_parameters=decayed_parameters(front.spec.module),
        buffer_bytes=chain.buffer_bytes,
        block_buffers=tuple(b.buffers for b in chain.blocks),
    )


def sequence_parallel(options: CompileOptions) -> bool:
    """Whether the search's plans use sequence parallelism (where TP > 1): as pinned, else on.
    It is not searched both ways (that would repeat every TP layout): it moves the bytes TP alone
    moves (a reduce-scatter and an all-gather for each all-reduce, so twice the collectives'
    latencies) and holds the norms' and residuals' activations t times smaller (Korthikanti et
    al., MLSys'23); where a value's sequence does not split t ways it stays whole
    (``autopart.solve.sequence``). ``benchmarks/plan_quality.py --dimensions`` searches both."""
    return True if options.sp is None else bool(options.sp)
