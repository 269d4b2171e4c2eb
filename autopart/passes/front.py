"""The front of the compiler as one value: load, capture, annotate, cut into blocks, shard.

`Front` keeps what these passes give, so that the plan search can cost many layouts from one
capture and emitting needs no second one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from torch import fx, nn

from autopart.ir.model_file import ModelSpec, is_meta, load_model_file
from autopart.ir.placement import Placement
from autopart.ir.plan import Plan, takes_gradient
from autopart.ir.scatter_gather import gathered, held_bytes
from autopart.ir.tensors import TensorMeta
from autopart.options import CompileOptions, local_kind
from autopart.passes.annotate import OpGraph, annotate
from autopart.passes.blocks import BlockChain, build_blocks
from autopart.passes.buffer_writes import normalises_by_batch
from autopart.passes.capture import Graph, capture
from autopart.passes.early_refusals import refuse_early
from autopart.passes.recompute import recompute_cost
from autopart.passes.rewrite import separate_biases
from autopart.profiling.measure_defaults import co_run_processes
from autopart.profiling.profile import profile_costs
from autopart.runtime.materialise import check_buffers_made, check_initialisers
from autopart.solve.sequence import boundary_placement
from autopart.solve.sharding import op_name
from autopart.solve.tensor import BlockSharding, shard_chain
from cost_models import CostDatabase, CostModel, ProfiledCostModel, get_cost_model

__all__ = ["Front", "annotated", "block_seconds", "boundary_gathered_bytes", "boundary_held_bytes", "build_front",
           "batch_statistics_ops", "block_weight_seeds", "capture_for", "held_tensors", "layer_input_bytes",
           "layer_rebuilt_bytes", "loss_working_bytes", "note_batch_statistics", "note_unsplit", "parameter_placements", "recompute_blocks",
           "sharded"]

log = logging.getLogger("autopart")


@dataclass(frozen=True, kw_only=True)
class Front:
    """What the front passes give: kept so that emitting needs no second capture."""

    spec: ModelSpec
    op_graph: OpGraph
    chain: BlockChain
    cost_model: CostModel = field(repr=False)
    shardings: tuple[BlockSharding, ...] | None = None  # per block, when tp > 1
    timed: int = 0  # ops timed for the cost database during this compile


def capture_for(spec: ModelSpec, tp: int, **how) -> Graph:
    """The training graph, with biases as ops of their own when ops will be split (see rewrite.py)."""
    graph = capture(spec, **how)
    return separate_biases(graph) if tp > 1 else graph


def build_front(options: CompileOptions, micro_batch_size: int) -> Front:
    """The front of a layout given in full (pinned, or from --plan): refused, right after the
    capture, where its ZeRO level cannot shard a parameter that the captured graph holds
    (`autopart.passes.early_refusals`)."""
    return sharded(annotated(options, micro_batch_size, separate_biases=options.tp > 1), options)


def sharded(front: Front, options: CompileOptions) -> Front:
    """``front`` with every block's tensor-parallel strategy chosen for ``options.tp``."""
    if options.tp == 1:
        return replace(front, shardings=None)
    shardings = tuple(shard_chain(front.chain, tp=options.tp, cost_model=front.cost_model,
                                  nodes=options.tensor_parallel_span.nodes, sequence_parallel=bool(options.sp),
                                  overlap=options.tp_overlap, fewest=options.tensor_parallel_span.fewest))
    return replace(front, shardings=shardings)


def note_unsplit(options: CompileOptions, front: Front) -> None:
    """A --tp that divides no weight runs the whole model on every rank of its group: say so."""
    if front.shardings and not any(p.kind == "S" for sharding in front.shardings for p in sharding.parameters.values()):
        log.info(f"--tp {options.tp} splits no weight of {front.spec.path.name}: none divides {options.tp} ways, or"
                 f" splitting would be slower than running it whole; each of the {options.tp} ranks holds and computes"
                 " the whole model (lower --tp, or use --pp or --dp)")


def _leaf_batch_statistics(node: fx.Node, graph: fx.Graph) -> bool:
    """``node`` calls a ``--leaf`` module (traced whole, its ops unseen) holding a BatchNorm in training."""
    if node.op != "call_module" or graph.owning_module is None:
        return False
    batch_norm = nn.modules.batchnorm._BatchNorm  # BatchNorm1d/2d/3d, SyncBatchNorm and the lazy ones
    return any(isinstance(m, batch_norm) and m.training for m in graph.owning_module.get_submodule(str(node.target)).modules())


def batch_statistics_ops(graph: fx.Graph) -> tuple[str, ...]:
    """The ops of ``graph`` that normalise by their batch's statistics (`normalises_by_batch`), and
    the ``--leaf`` modules holding a BatchNorm in training: what `Plan.batch_statistics` names."""
    return tuple(node.name for node in graph.nodes if normalises_by_batch(node) or _leaf_batch_statistics(node, graph))


def note_batch_statistics(plan: Plan) -> None:
    """BatchNorm in training normalises by its batch's statistics, and a pipeline's batch is a
    microbatch, a replica's its share: the model trains as BatchNorm over fewer samples than the
    global batch (as torch's DDP without SyncBatchNorm does). Said where it is so."""
    samples = plan.schedule.micro_batch_size
    if samples == plan.schedule.global_batch_size or not plan.batch_statistics:
        return
    log.info(f"{len(plan.batch_statistics)} BatchNorm op(s) normalise by the statistics of each microbatch of {samples} "
             f"samples, not of the global batch of {plan.schedule.global_batch_size}: the model trains as BatchNorm "
             f"over {samples} (autopart verify's reference splits the batch as the plan does); a global batch in one "
             "microbatch of one replica keeps the model's own")


def annotated(options: CompileOptions, micro_batch_size: int, *, separate_biases: bool,
               spec: ModelSpec | None = None, roofline: CostModel | None = None,
               measured: dict[tuple, tuple] | None = None, graph: Graph | None = None,
               ranks_from: CompileOptions | None = None) -> Front:
    """Capture, cost and cut into blocks; ``separate_biases`` for graphs whose ops will be split.
    ``spec`` and ``roofline``: the model and device cost model of an earlier call, to reuse;
    ``measured``: ops' kernels and times by cost key (``annotate``), shared by calls that cost
    alike (without a cost database, which may gain entries between calls); ``graph``: an earlier
    fx capture of the same model at any micro-batch size (fx graphs hold no batch size);
    ``ranks_from``: the options whose ranks on one host compute at once, where ``options`` are a
    search's for one capture (which hold one rank): the model's co-run slowdown is measured for
    them with its ops, so that every plan costed on this front sees it; and whose asks of the model
    are refused right after the capture where it cannot meet them (`refuse_early`)."""
    roofline = roofline or get_cost_model(options.device)  # a bad device spec fails before the slow passes
    if spec is None:
        spec = load_model_file(options.model)
        if is_meta(spec.module):  # each rank will make its own weights: every module needs an initialiser
            check_initialisers(spec.module, spec.init_weights, spec.path.name)
            check_buffers_made(spec.module, spec.init_weights)
    if graph is None or graph.method != "fx":
        graph = capture_for(spec, 2 if separate_biases else 1, batch_size=micro_batch_size, method=options.capture,
                         leaves=options.leaf)
        refuse_early(ranks_from or options, graph, spec)  # before any op is timed
    database, timed = None, 0
    if options.costs is not None:
        database = CostDatabase.load(options.costs)
        local = local_kind(options.device)
        if local is not None:
            timed = profile_costs(graph, spec, database, device=local, micro_batch_size=micro_batch_size,
                                  optimizer=options.optimizer, dtype=options.dtype,
                                  processes=co_run_processes(ranks_from or options, local, roofline.device.cores))
            if timed:
                database.save()
    cost_model = roofline if database is None else ProfiledCostModel(roofline=roofline, database=database)
    op_graph = annotate(graph, spec, cost_model, micro_batch_size=micro_batch_size, dtype=options.dtype,
                        measured=measured if database is None else None)
    chain = build_blocks(op_graph)
    return Front(spec=spec, op_graph=op_graph, chain=chain, cost_model=cost_model, timed=timed)


def parameter_placements(front: Front) -> dict[str, Placement]:
    placements: dict[str, Placement] = {}
    for sharding in front.shardings or ():
        placements.update(sharding.parameters)
    return placements


def block_seconds(front: Front) -> list[tuple[float, float, float]]:
    """Per block: forward, backward and weight-gradient seconds on one rank, after sharding."""
    times = []
    for k, block in enumerate(front.chain.blocks):
        scale = 1.0
        if front.shardings is not None and block.forward_s + block.backward_s > 0:
            scale = front.shardings[k].time_s / (block.forward_s + block.backward_s)
        times.append((block.forward_s * scale, block.backward_s * scale, block.backward_weight_s * scale))
    return times


def layer_input_bytes(front: Front, tp: int) -> tuple[int, ...]:
    """Per block, what a layer that begins there keeps under full recompute on one rank: what
    enters it, as the rank holds it (`boundary_held_bytes`); none at the first block."""
    return (0, *boundary_held_bytes(front, tp))


def boundary_held_bytes(front: Front, tp: int) -> tuple[int, ...]:
    """Per block boundary, the bytes of what crosses it that one rank holds (`held_tensors`)."""
    return tuple(sum(held_bytes(meta, tp) for _, meta in held_tensors(front, b.tensors, k + 1, tp))
                 for k, b in enumerate(front.chain.boundaries))


def boundary_gradients(front: Front) -> tuple[bool, ...]:
    """Per block boundary, whether a gradient comes back across it: the rule a plan's stages
    follow (`autopart.ir.plan.gradient_boundaries`), for the cutters to charge a gradient message
    only where one crosses (none behind a frozen prefix)."""
    return tuple(any(takes_gradient(b.tensors, no_grad_values(front.op_graph, [name for name, _ in b.tensors])))
                 for b in front.chain.boundaries)


def no_grad_values(op_graph: OpGraph, names: Sequence[str]) -> tuple[str, ...]:
    """The floating values of ``names`` that need no gradient (`autopart.passes.grad_flow`): a
    stage that receives them sends none back (`autopart.ir.plan.StagePlan.no_grad_inputs`)."""
    costs = [op_graph.nodes[name] for name in names]
    return tuple(c.name for c in costs if c.output is not None and c.output.dtype.startswith(("float", "bfloat"))
                 and not c.needs_grad)


def boundary_gathered_bytes(front: Front, tp: int) -> tuple[int, ...]:
    """Per block boundary, the bytes of the replicated tensors crossing it that travel in ``tp``
    parts and are all-gathered on arrival (`autopart.ir.scatter_gather.gathered`)."""
    return tuple(sum(meta.nbytes for _, meta in held_tensors(front, b.tensors, k + 1, tp) if gathered(meta, tp))
                 for k, b in enumerate(front.chain.boundaries))


def held_tensors(front: Front, tensors, receiver: int, tp: int) -> tuple[tuple[str, TensorMeta], ...]:
    """``tensors`` ((name, meta) pairs) as they enter block ``receiver`` on each of ``tp`` ranks,
    which send, receive and keep them so: where the blocks run sequence-parallel, the residual
    stream is each rank's slice of the sequence (``TensorMeta.split_dim``), as the sharding solver
    placed it between them (`autopart.solve.sequence.boundary_placement`); anything else whole."""
    tensors = tuple(tensors)
    if tp == 1 or front.shardings is None or not tensors or not front.shardings[receiver].sequence_parallel:
        return tensors
    placed = [(name, meta, boundary_placement(front.op_graph, name, tp, True)) for name, meta in tensors]
    return tuple((name, replace(meta, split_dim=p.dim) if p.kind == "S" else meta) for name, meta, p in placed)


def recompute_blocks(front: Front, modes: list[str], layers: Sequence[tuple[int, int]] = (), *, tp: int = 1
                     ) -> tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
    """Per block, in the recompute mode of its stage: forward and backward seconds (the recompute
    included), the bytes it holds per microbatch in flight (a stage's inputs not included), and
    the bytes its recompute rebuilds, held while a microbatch's backward runs.

    ``layers``: the repeated layers (first, end blocks) that full recompute checkpoints one by
    one (`autopart.passes.recompute.checkpointed_layers`): a layer's first block holds what enters
    it (`layer_input_bytes` at ``tp``), the others nothing; each layer rebuilds its activations
    apart from the stage's, which `layer_rebuilt_bytes` gives. The caller gives their stages'
    other blocks ``none``."""
    start = {begin: end for begin, end in layers}
    entering = layer_input_bytes(front, tp) if layers else ()
    inside = {k for begin, end in layers for k in range(begin, end)}
    times, held, rebuilt = [], [], []
    shares = _saved_shares(front)
    for k, (block, (forward, backward, _)) in enumerate(zip(front.chain.blocks, block_seconds(front))):
        cost = recompute_cost([block], modes[k], input_bytes=0)
        scale = forward / block.forward_s if block.forward_s > 0 else 1.0  # the tensor-parallel share
        shard = shares[k]
        times.append(forward + backward + cost.extra_backward_s * scale)
        if k in inside:
            held.append(entering[k] if k in start else 0)
            rebuilt.append(0)
        else:
            held.append(round(cost.saved_bytes * shard))
            rebuilt.append(round(cost.transient_bytes * shard))
    return tuple(times), tuple(held), tuple(rebuilt)


def layer_rebuilt_bytes(front: Front, layers: Sequence[tuple[int, int]]) -> int:
    """The most that full recompute's backward rebuilds at once when it checkpoints ``layers``
    one by one: the largest layer's activations (one tensor-parallel rank's share)."""
    chain, shares = front.chain, _saved_shares(front)
    return max((round(sum(chain.blocks[k].saved_bytes * shares[k] for k in range(begin, end))) for begin, end in layers),
               default=0)


def block_weight_seeds(front: Front) -> tuple[int, ...]:
    """Per block, what a split backward's I keeps for its W on one tensor-parallel rank
    (`autopart.passes.weight_seeds`)."""
    if front.shardings is not None:
        return tuple(s.weight_seed_bytes for s in front.shardings)
    return tuple(b.weight_seed_bytes for b in front.chain.blocks)


def _saved_shares(front: Front) -> list[float]:
    """Per block, the share of its saved bytes that one tensor-parallel rank holds."""
    return [front.shardings[k].saved_bytes / b.saved_bytes if front.shardings and b.saved_bytes else 1.0
            for k, b in enumerate(front.chain.blocks)]


_CROSS_ENTROPY = frozenset({"cross_entropy", "cross_entropy_loss", "vocab_parallel_cross_entropy"})
_FLOATS = frozenset({"float32", "bfloat16", "float16"})


def loss_working_bytes(front: Front, tp: int) -> int:
    """What the loss's backward holds beside the saved activations, on the rank of the last
    stage: the gradient of each of its float inputs in fp32 (autocast runs losses in fp32), and
    for a cross-entropy the gradient of its log-probabilities too, both the logits' size (a
    vocabulary-parallel one's 1/tp). At 128k words and 8k tokens that is 8 GB: more than a layer
    saves, and what nothing else counts."""
    graph = front.op_graph.graph.module.graph
    output = next(node for node in graph.nodes if node.op == "output")
    loss = output.args[0] if isinstance(output.args[0], fx.Node) else None
    if loss is None or loss.op != "call_function":
        return 0
    # a batch input (the target) takes no gradient
    inputs = [front.op_graph.nodes[a.name].output for a in loss.all_input_nodes
              if a.op != "placeholder" and a.name in front.op_graph.nodes]
    elements = sum(meta.numel for meta in inputs if meta is not None and meta.dtype in _FLOATS)
    split = tp if _vocabulary_parallel(front, loss.name) else 1
    return (2 if op_name(loss) in _CROSS_ENTROPY else 1) * 4 * elements // split


def _vocabulary_parallel(front: Front, name: str) -> bool:
    """Whether the sharding split the loss over the vocabulary (each rank its 1/t of the logits)."""
    return any(name in sharding.strategies and sharding.strategies[name].kind == "vocab_parallel_cross_entropy"
               for sharding in front.shardings or ())
