"""The one step-time model: a plan's step as the runtime times it.

The pipeline's actions with their fixed costs and the compute factor of the ranks running
side by side, its messages, then each rank's tail (tied-gradient sums, the optimizer step) and
the data-parallel gradient exchange; with the figures this very pipeline measured where
``--profile-pipeline`` ran it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import replace

from autopart.codegen.layers import layer_instances
from autopart.ir.actions import RECEIVE_KINDS, Action
from autopart.ir.owners import partition
from autopart.ir.placement import REPLICATE
from autopart.ir.plan import StagePlan, gradient_boundaries
from autopart.ir.scatter_gather import sent_bytes
from autopart.options import CompileOptions
from autopart.passes.front import Front, block_seconds, parameter_placements
from autopart.predict.data_parallel import DataParallelComm, data_parallel_comm
from autopart.predict.fully_sharded import Piece
from autopart.predict.memory import optimizer_groups
from autopart.predict.reduction import overlapped_step_time, plan_reductions
from autopart.profiling.co_run import co_run_key, host_processes
from autopart.profiling.pipeline import pipeline_key
from autopart.runtime.recipe import decayed_parameters
from autopart.schedule import SPLIT_BACKWARD_KINDS, Schedule, StageCosts, built, built_lowered
from cost_models.database import PipelineMeasurement, plan_shape, tail_key

__all__ = ["compute_factor", "counted_background_load", "data_parallel", "data_parallel_seconds", "fully_sharded_pieces", "with_collectives", "measured_in_place", "predicted_step_s", "profiled_step", "rank_tails", "timed_schedule"]


def data_parallel(options: CompileOptions, front: Front, stages: list[StagePlan]) -> list[DataParallelComm]:
    """Per stage, the seconds its data-parallel collectives add (`autopart.predict.data_parallel`),
    over the nodes a data-parallel group spans."""
    device = front.cost_model.device
    pieces = fully_sharded_pieces(front, stages, options.tp) if options.zero == 3 and options.dp > 1 else None
    return [data_parallel_comm(options.zero, stage.parameter_bytes / options.tp, dp=options.dp,
                               nodes=options.data_parallel_span.nodes, members=options.data_parallel_span.fewest,
                               cost_model=front.cost_model,
                               overlapped=device.collectives_overlap_compute, slowdown=device.slowdown_beside_collectives,
                               hidden_behind_s=stage.forward_s, dtype=options.dtype, pieces=pieces[i] if pieces else (),
                               trained=_trained_share(front, stage))
            for i, stage in enumerate(stages)]


def _trained_share(front: Front, stage: StagePlan) -> float:
    """The share of a stage's parameter bytes that train (a fine-tune's frozen base: none of its)."""
    sizes = front.chain.parameter_bytes
    total = sum(sizes[p] for p in stage.parameters)
    frozen = sum(sizes[p] for p in stage.parameters if p in front.chain.frozen_parameters)
    return 1.0 - frozen / total if total else 1.0


def fully_sharded_pieces(front: Front, stages: list[StagePlan], tp: int) -> list[tuple[Piece, ...]]:
    """Per stage, its compute in forward order for ZeRO-3 (`autopart.predict.fully_sharded`):
    each repeated layer it holds whole one unit, as the runtime makes it (`autopart.codegen.layers`),
    each other block the root unit's; the blocks' seconds scaled to the stage's own."""
    instances, times = layer_instances(front.chain), block_seconds(front)
    return [_stage_pieces(front, stage, tp, instances, times) for stage in stages]


def _stage_pieces(front: Front, stage: StagePlan, tp: int, instances, times) -> tuple[Piece, ...]:
    first, last = stage.blocks
    units = {}
    for begin, end, own in instances:
        if first <= begin and end - 1 <= last:
            units[begin] = (end, sum(front.chain.parameter_bytes[p] for p in own) / tp)
    forward = sum(times[k][0] for k in range(first, last + 1))
    backward = sum(times[k][1] for k in range(first, last + 1))
    forward_scale = stage.forward_s / forward if forward > 0 else 0.0
    backward_scale = stage.backward_s / backward if backward > 0 else 0.0
    pieces, k = [], first
    while k <= last:
        end, unit_bytes = units.get(k, (k + 1, 0.0))
        pieces.append(Piece(forward_s=sum(times[j][0] for j in range(k, end)) * forward_scale,
                            backward_s=sum(times[j][1] for j in range(k, end)) * backward_scale, unit_bytes=unit_bytes))
        k = end
    return tuple(pieces)


def with_collectives(stages: list[StagePlan], comm: list[DataParallelComm]) -> list[StagePlan]:
    """The stages as the step runs them: each forward and backward with its gathers and reductions."""
    return [replace(st, forward_s=st.forward_s + c.forward_s, backward_s=st.backward_s + c.backward_s)
            for st, c in zip(stages, comm)]


def data_parallel_seconds(stages: list[StagePlan], comm: list[DataParallelComm]) -> float:
    """The busiest rank's collectives after the pipeline drains (not overlapped)."""
    per_rank: dict[int, float] = {}
    for stage, c in zip(stages, comm):
        per_rank[stage.rank] = per_rank.get(stage.rank, 0.0) + c.tail_s
    return max(per_rank.values())


def _tied_all_reduce_s(cost_model, options: CompileOptions, nbytes: int, ranks: set[int]) -> float:
    """The sum of a tied weight's gradient over the pipeline ranks that hold it, on the nodes
    those ranks' first replica sits on (pipeline rank r is global rank r * tp there), crossing
    between them at the NICs of the node holding the fewest."""
    counts = Counter(rank * options.tp // options.gpus_per_node for rank in ranks)
    return cost_model.collective_time("all_reduce", nbytes, len(ranks), nodes=len(counts), members=min(counts.values()))


def rank_tails(options: CompileOptions, front: Front, stages: list[StagePlan], holders: dict[str, list[int]],
                in_place: PipelineMeasurement | None) -> dict[int, float]:
    """Per rank, what the step does after the pipeline: sum tied gradients, step the optimizer;
    each as this pipeline measured it where it was run (``in_place``), else modelled."""
    cost_model = front.cost_model
    metas = {str(n.target): front.op_graph.nodes[n.name].output
             for n in front.op_graph.fx_nodes() if front.op_graph.nodes[n.name].is_parameter}
    for leaf in front.op_graph.leaf_tensors.values():  # the weights of --leaf modules
        metas.update(leaf)
    placements = parameter_placements(front)
    shapes = {p: _local_shape(meta.shape, placements.get(p, REPLICATE), options.tp) for p, meta in metas.items()}
    decayed = decayed_parameters(front.spec.module)
    tails = {}
    for rank in range(options.pp):
        # each stage's module holds its own copy of a weight that two of the rank's stages read; a
        # frozen one has no gradient to sum nor to step
        copies = [p for st in stages if st.rank == rank for p in dict.fromkeys(st.parameters)
                  if p not in front.chain.frozen_parameters]
        tied = sum(_tied_all_reduce_s(cost_model, options, metas[p].nbytes * math.prod(shapes[p]) // metas[p].numel,
                                      {stages[s].rank for s in holders[p]})
                   for p in dict.fromkeys(copies) if len(holders[p]) > 1)
        if tied and in_place is not None and in_place.tied_s is not None:
            tied = in_place.tied_s
        measured = in_place.optimizer_time([st.blocks for st in stages if st.rank == rank]) if in_place else None
        replicas = _replica_parameters(options, copies, shapes, decayed)
        optimizer = max(cost_model.optimizer_time(options.optimizer, [(shapes[p], metas[p].dtype) for p in mine])
                        for mine in replicas)
        if options.zero and options.dp > 1 and int(options.zero) != 1:  # each data-parallel rank steps its shard
            optimizer /= options.dp
        if measured is not None:
            optimizer = measured
        tails[rank] = tied + optimizer
    return tails


def _local_shape(shape: tuple[int, ...], placement, tp: int) -> tuple[int, ...]:
    """A parameter's shape on one rank of the tensor-parallel group."""
    if placement.kind != "S" or tp == 1:
        return tuple(shape)
    return tuple(size // tp if dim == placement.dim else size for dim, size in enumerate(shape))


def _replica_parameters(options: CompileOptions, held: list[str], shapes: dict[str, tuple[int, ...]],
                        decayed: frozenset[str]) -> list[list[str]]:
    """Of a rank's parameters (of ``shapes`` on its tensor-parallel rank), those each replica
    steps: under ZeRO-1 with replicas each owner's whole tensors (`autopart.ir.owners`, in its
    optimizer's groups, ``decayed`` first), and the step ends once every owner has shared its
    weights, so the rank waits for the slowest; else all of them."""
    if int(options.zero) != 1 or options.dp == 1:
        return [held]
    names = optimizer_groups(held, dtype=options.dtype or "fp32", decayed=decayed)
    mine: list[list[str]] = [[] for _ in range(options.dp)]
    for group, owners in zip(names, partition([[math.prod(shapes[n]) for n in group] for group in names], options.dp)):
        for name, owner in zip(group, owners):
            mine[owner].append(name)
    return mine


def measured_in_place(options: CompileOptions, front: Front, micro_batch_size: int, stages: list[StagePlan], *,
                      sp: bool, tp_overlap: bool) -> PipelineMeasurement | None:
    """What this very pipeline measured as it ran (``--profile-pipeline``), if it was: keyed as
    `autopart.profiling.pipeline.plan_pipeline_key` keys the plan that ``stages`` make (``sp`` and
    ``tp_overlap`` as that plan holds them)."""
    mesh = {"pp": options.pp, "tp": options.tp, "dp": options.dp}
    key = pipeline_key(front.spec.sources_sha256, mesh, micro_batch_size, options.optimizer,
                       dtype=options.dtype or "fp32", zero=options.zero or 0,
                       recompute=tuple(stage.recompute for stage in stages), sp=sp, tp_overlap=tp_overlap,
                       capture=front.op_graph.graph.method, leaves=options.leaf)
    return front.cost_model.pipeline_profile(key)


def profiled_step(options: CompileOptions, stages: list[StagePlan], microbatches: int,
                   in_place: PipelineMeasurement | None) -> float | None:
    """The median step this very plan took when ``--profile-pipeline`` ran it, if it did."""
    if in_place is None or in_place.step_of != plan_shape(options.schedule, microbatches, [s.blocks for s in stages]):
        return None
    return in_place.step_s


def compute_factor(options: CompileOptions, front: Front, stages: list[StagePlan],
                    in_place: PipelineMeasurement | None) -> tuple[tuple[float, ...], str]:
    """Per stage, how many times its profiled time each forward and backward takes inside this
    pipeline, and where the figures are from: "pipeline" where this very pipeline was run and
    measured (``--profile-pipeline``); "co-run" where the model was timed beside as many copies
    of itself as the host's ranks compute at once (`autopart.profiling.co_run`: the ranks of one
    host, at most one per core; a plan spread over hosts shares only its host's cores); "device"
    for the device's own (``profile-comm``'s tiny layer on a CPU); "none"."""
    if in_place is not None:
        return tuple(in_place.stage_factor(stage.blocks) for stage in stages), "pipeline"
    processes = host_processes(options.ranks_per_host, front.cost_model.device.cores)
    co_run = front.cost_model.co_run(co_run_key(options.dtype, processes)) if processes > 1 else None
    if co_run is not None:
        return (co_run.factor,) * len(stages), "co-run"
    # a rank computes beside the others and their messages
    device = front.cost_model.pipeline_compute_factor() if options.pp > 1 else 1.0
    return (device,) * len(stages), "device" if device != 1.0 else "none"


def predicted_step_s(options: CompileOptions, front: Front, stages: list[StagePlan], transfer: tuple[float, ...],
               tails: dict[int, float], microbatches: int, factor: tuple[tuple[float, ...], str],
               in_place: PipelineMeasurement | None) -> tuple[float, dict[int, tuple[float, float]]]:
    """The step as the runtime times it, and per rank what its data-parallel reductions added
    (`autopart.predict.reduction`): the pipeline with the fixed cost of each action, each forward
    and backward of stage s ``factor[0][s]`` times its profiled time, its messages as this
    pipeline measured them where it was run (``in_place``), on ranks that share the device's
    cores when it has them, then each rank's data-parallel wait and its tail. Where this pipeline was run, the median of its
    steps replayed: each step measured there with its actions, deliveries and tails as they
    moved from their medians in that step. A step waits for its slowest rank and its latest
    message, and a busy machine's slow moments catch the ranks at different times, so the step
    of the median action times is shorter than the median step."""
    overheads = front.cost_model.runtime_overheads
    fixed = [overheads.action_costs(recompute=s.recompute != "none", split=options.schedule in SPLIT_BACKWARD_KINDS)
             for s in stages]
    # per boundary, the rank time of its messages (one per tensor) on each side; the rest is latency
    sides = [[front.cost_model.p2p_rank_time(sent_bytes(m, options.tp),
                                             across_nodes=options.pipeline_crosses_nodes)
              for _, m in st.outputs] for st in stages[:-1]]
    send = tuple(sum(s for s, _ in boundary) for boundary in sides)
    receive = tuple(sum(r for _, r in boundary) for boundary in sides)
    waited: tuple[float, ...] = ()
    if in_place is not None and in_place.transfer_s is not None:  # one message per boundary, as measured
        send, receive = (in_place.send_s,) * len(sides), (in_place.recv_s,) * len(sides)
        transfer = tuple(in_place.send_s + in_place.recv_s + in_place.transfer_s for _ in sides)
        if in_place.waited_s is not None:  # a receive that waits ends waited_s after its send
            waited = (min(in_place.recv_s, in_place.waited_s),) * len(sides)
    device = front.cost_model.device
    background = counted_background_load(device.background_load, in_place)
    # the other tensor- and data-parallel ranks of the machine run the same work beside this pipeline
    cores = device.cores / (options.tp * options.dp)
    # measured in place, the factor holds what waking and refilling a shared core cost the compute
    resume = (0.0, 0.0) if in_place is not None else (overheads.resume_forward_s, overheads.resume_backward_s)

    slower = factor[0]
    costs = StageCosts(
        forward_s=tuple(f * s.forward_s + x[0] for f, s, x in zip(slower, stages, fixed)),
        backward_s=tuple(f * s.backward_s + x[1] for f, s, x in zip(slower, stages, fixed)),
        weight_s=tuple(f * s.backward_weight_s + x[2] for f, s, x in zip(slower, stages, fixed)),
        transfer_s=tuple(max(0.0, t - s - r) for t, s, r in zip(transfer, send, receive)),
        send_s=send,
        recv_s=receive,
        recv_waited_s=waited,
        gradients=gradient_boundaries(stages),
    )

    schedule = timed_schedule(options.schedule, options.pp, microbatches, options.chunks, costs,
                              cores=cores, replayed=in_place is not None)
    replicas = options.dp if options.zero not in (2, 3) else 1  # FSDP reduces in its own backward hooks
    reductions = plan_reductions(schedule, stages, front.chain, [b for _, b, _ in block_seconds(front)], tp=options.tp,
                                 dp=replicas, cost_model=front.cost_model,
                                 nodes=options.data_parallel_span.nodes, members=options.data_parallel_span.fewest)

    def step(costs: StageCosts, tails: dict[int, float]) -> tuple[float, dict[int, tuple[float, float]]]:
        return overlapped_step_time(schedule, costs, reductions, ranks=options.pp, cores=cores,
                                    background=background, tail_s=tails, resume_s=resume,
                                    slowdown=device.slowdown_beside_collectives, placement=[s.rank for s in stages],
                                    busy_delay_s=front.cost_model.p2p_busy_delay(),
                                    wake_s=None if in_place is not None else front.cost_model.wake_time)

    if in_place is None or not in_place.step_variation:
        return step(costs, tails)
    actions = [action for on_rank in schedule.values() for action in on_rank]
    return statistics.median(
        step(replace(costs, actions=_replayed(costs, actions, moved)),
             {rank: seconds * moved.get(tail_key(rank), 1.0) for rank, seconds in tails.items()})[0]
        for moved in in_place.step_variation
    ), step(costs, tails)[1]


def counted_background_load(now: float, in_place: PipelineMeasurement | None) -> float:
    """The other busy processes that the step shares the cores with beyond what its times hold:
    all of them (``now``) for ops timed alone, those beyond the ones that ran beside the measured
    pipeline for its replayed actions, which took their share already."""
    return now if in_place is None else max(0.0, now - in_place.background_load)


def timed_schedule(kind: str, ranks: int, microbatches: int, chunks: int, costs: StageCosts, *, cores: float,
                   replayed: bool) -> Schedule:
    """The schedule the step model runs: with its sends and receives where they take rank time,
    the ranks share ``cores`` (a receive then waits on a core, `autopart.schedule.shared.step_time`)
    or a measured step is ``replayed`` action by action; else its compute order alone, which a
    device per rank times as its lowering (`autopart.schedule.simulate`), with a third of the
    actions and no lowering to build: a named GPU's messages move on its copy engines and NICs."""
    if cores > 0 or replayed or costs.messages_take_rank_time:
        return built_lowered(kind, ranks, microbatches, chunks)
    return built(kind, ranks, microbatches, chunks)[0]


def _replayed(costs: StageCosts, actions: list[Action], moved: dict[str, float]) -> dict[Action, float]:
    """The actions' times in one measured step (`PipelineMeasurement.step_variation`): each
    compute action and send its time times its multiple, each receive its time plus the
    lateness of its delivery."""
    times = {}
    for action in actions:
        change = moved.get(str(action))
        if change is not None:
            receive = action.kind in RECEIVE_KINDS
            times[action] = max(0.0, costs.duration(action) + change) if receive else costs.duration(action) * change
    return times
