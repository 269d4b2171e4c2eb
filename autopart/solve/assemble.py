"""Plan assembly: the pipeline problem of a front, and the Plan of the cuts a solver chose.

Both the single-layout compile and the plan search build their problems and plans here, so a
plan means the same whichever of them made it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

import autopart
from autopart.codegen.layers import layer_instances, layer_parameters
from autopart.codegen.stages import stage_boundaries
from autopart.ir.placement import REPLICATE
from autopart.ir.plan import Plan, Predicted, Provenance, ScheduleSpec, StagePlan, takes_gradient
from autopart.options import CompileOptions
from autopart.passes.annotate import OpGraph
from autopart.passes.front import (
    Front, batch_statistics_ops, block_seconds, block_weight_seeds, boundary_gradients, held_tensors, layer_input_bytes,
    layer_rebuilt_bytes, loss_working_bytes, no_grad_values, parameter_placements, recompute_blocks,
)
from autopart.passes.recompute import (
    batch_inputs, checkpointed_layers, recompute_cost, stage_input_bytes, stage_modes,
)
from autopart.predict.accuracy import ceiling_step_s
from autopart.predict.in_flight import in_flight, rank_in_flight, transient, weight_pending
from autopart.predict.memory import layers_in_flight_bytes, optimizer_group, owned_bytes, state_bytes
from autopart.predict.messages import boundary_seconds
from autopart.predict.step_time import (
    compute_factor, counted_background_load, data_parallel, data_parallel_seconds, measured_in_place, predicted_step_s, profiled_step, rank_tails,
    with_collectives,
)
from autopart.predict.timeline import simulate_pipeline
from autopart.runtime.recipe import decayed_parameters, embedding_parameters
from autopart.schedule import SPLIT_BACKWARD_KINDS, generated, stage_placement
from autopart.solve.pipeline import PipelineProblem, evaluate, stage_ranges
from autopart.solve.sequence import boundary_placement
from autopart.solve.tensor import listed_strategies
from cost_models.devices import DeviceSpec
from cost_models.memory import communicator_bytes

__all__ = ["pipeline_problem", "plan_from_cuts", "layered_parameters", "with_solver"]


def pipeline_problem(options: CompileOptions, front: Front, microbatches: int) -> PipelineProblem:
    chain, cost_model = front.chain, front.cost_model
    stages = options.pp * options.chunks
    device = cost_model.device
    memory = round(options.memory_gib * (1 << 30)) if options.memory_gib is not None else device.memory_bytes
    # The cuts are not known yet: with one recompute mode for every stage the blocks carry its
    # figures (a stage's inputs, which recompute keeps, are left out); with modes that differ per
    # stage they carry no recompute's. plan_from_cuts computes the chosen stages' figures exactly.
    modes = set(stage_modes(options.recompute, stages))
    mode = modes.pop() if len(modes) == 1 else "none"
    layers = _checkpointed_layers(options, chain, [range(len(chain.blocks))] if mode == "full" else [])
    times, saved, rebuilt = recompute_blocks(front, _block_modes(chain, [mode], [range(len(chain.blocks))], layers),
                                             layers, tp=options.tp)
    local = _local_bytes(options, front)
    layered, layer_bytes = layered_parameters(chain, local)
    frozen = front.chain.frozen_parameters
    state = {name: _state_bytes(options, nbytes, layered=name in layered, frozen=name in frozen)
             for name, nbytes in local.items()}
    return PipelineProblem(
        block_time_s=times,
        block_activation_bytes=saved,
        **_rebuilding(options, rebuilt, microbatches),
        boundary_transfer_s=tuple(boundary_seconds(options, cost_model, held_tensors(front, b.tensors, k + 1, options.tp))
                                  for k, b in enumerate(chain.boundaries)),
        boundary_gradients=boundary_gradients(front),
        parameter_state_bytes=state,
        block_parameters=tuple(b.parameters for b in chain.blocks),
        stages=stages,
        microbatches=microbatches,
        in_flight=in_flight(options.schedule, options.pp, microbatches, options.chunks),
        rank_in_flight=rank_in_flight(options.schedule, options.pp, microbatches, options.chunks),
        memory_limit_bytes=memory,
        # full recompute layer by layer: one layer's rebuild on every rank, as its stages' cuts are not known
        overhead_bytes=_overhead_bytes(options, device, layer_bytes) + layer_rebuilt_bytes(front, layers),
        stage_rank=stage_placement(options.schedule, ranks=options.pp, chunks=options.chunks),
        split_layers=_split_layers(options, chain, local, state, frozen),
        loss_working_bytes=loss_working_bytes(front, options.tp),
        **_weight_seeds(options, front, microbatches),
        owned_state=_owned_state(options, front, local),
        replicas=options.dp,
        buffer_bytes=chain.buffer_bytes,
        block_buffers=tuple(b.buffers for b in chain.blocks),
    )


def _owned_state(options: CompileOptions, front: Front, local: dict[str, int]) -> dict[str, tuple[int, int]]:
    """``PipelineProblem.owned_state``: per parameter, the bytes of its state that its ZeRO-1
    owner holds whole and its group as the rank's optimizer partitions them."""
    if int(options.zero) != 1 or options.dp == 1:
        return {}
    dtype = options.dtype or "fp32"
    decayed, frozen = decayed_parameters(front.spec.module), front.chain.frozen_parameters
    return {name: (owned_bytes(nbytes, optimizer=options.optimizer, dp=options.dp, zero=1, dtype=dtype,
                               frozen=name in frozen),
                   optimizer_group(dtype, name in decayed))
            for name, nbytes in local.items()}


def _split_layers(options: CompileOptions, chain, local: dict[str, int], state: dict[str, int],
                  frozen: frozenset[str]) -> tuple:
    """``PipelineProblem.split_layers``: at ZeRO-3, per repeated layer, what its parameters cost
    more where a cut splits it (they run in each stage's root unit, `autopart.codegen.layers`,
    rather than the layer's own, whose ``state`` they hold), summed over the parameters that the
    same blocks read."""
    if int(options.zero) != 3 or options.dp == 1:
        return ()
    found = []
    for first, end, own in layer_instances(chain):
        readers: dict[str, list[int]] = {}
        for k in range(first, end):
            for name in dict.fromkeys(chain.blocks[k].parameters):
                if name in own:
                    readers.setdefault(name, []).append(k)
        extra: dict[tuple[int, ...], int] = {}
        for name, blocks in readers.items():
            more = _state_bytes(options, local[name], layered=False, frozen=name in frozen) - state[name]
            extra[tuple(blocks)] = extra.get(tuple(blocks), 0) + more
        if end - first > 1 and any(extra.values()):
            found.append((first, end, tuple((nbytes, blocks) for blocks, nbytes in extra.items() if nbytes)))
    return tuple(found)


def plan_from_cuts(
    options: CompileOptions,
    front: Front,
    problem: PipelineProblem,
    cuts: tuple[int, ...],
    batch: tuple[int, int, int],
    solver: tuple[str, float, float],
) -> Plan:
    ranges = stage_ranges(cuts, len(front.chain.blocks))
    problem, recompute = _with_recompute(options, front, problem, ranges)
    evaluation = evaluate(problem, cuts)
    memory = evaluation.rank_memory_bytes
    stages, holders = _stage_plans(front, problem, ranges, recompute, options.tp)
    transfer = tuple(boundary_seconds(options, front.cost_model, st.outputs) for st in stages[:-1])
    total, microbatches, micro_batch_size = batch
    comm = data_parallel(options, front, stages)
    timed = with_collectives(stages, comm)
    timeline = simulate_pipeline(
        kind=options.schedule,
        ranks=options.pp,
        microbatches=microbatches,
        chunks=options.chunks,
        forward_s=tuple(s.forward_s for s in timed),
        backward_s=tuple(s.backward_s for s in timed),
        weight_s=tuple(s.backward_weight_s for s in stages),
        transfer_s=transfer,
    )
    sp = bool(options.sp) and options.tp > 1
    tp_overlap = sp and bool(options.tp_overlap)
    in_place = measured_in_place(options, front, micro_batch_size, stages, sp=sp, tp_overlap=tp_overlap)
    tails = rank_tails(options, front, stages, holders, in_place)
    factor = compute_factor(options, front, stages, in_place)
    step_s, reduction = predicted_step_s(options, front, timed, transfer, tails, microbatches, factor, in_place)
    gradient_sync = data_parallel_seconds(stages, comm)
    flops, peak = _model_flops(front.op_graph, total), _peak_flops(front.cost_model.device, options.dtype)
    modelled = step_s + gradient_sync
    ceiling_s = ceiling_step_s(front.cost_model, options.dtype, options.pp * options.tp * options.dp, flops, peak)
    return Plan(
        mesh={"pp": options.pp, "tp": options.tp, "dp": options.dp},
        stages=tuple(stages),
        schedule=ScheduleSpec(
            kind=options.schedule,
            microbatches=microbatches,
            micro_batch_size=micro_batch_size,
            global_batch_size=total,
            chunks=options.chunks,
            actions=generated(options.schedule, options.pp, microbatches, options.chunks).lists,
        ),
        predicted=Predicted(
            step_s=max(modelled, ceiling_s),
            unbounded_step_s=modelled if ceiling_s > modelled else None,
            bubble=timeline.bubble,
            memory_bytes=memory,
            p2p_bytes_per_step=microbatches * _message_bytes(stages),
            stage_time_s=evaluation.stage_time_s,
            transfer_s=transfer,
            pipeline_s=timeline.step_s,
            collective_s=tuple((c.forward_s, c.backward_s) for c in comm) if any(c.forward_s or c.backward_s for c in comm)
            else (),
            rank_tail_s=tuple(tails[r] for r in range(options.pp)),
            reduction_s=tuple(reduction.get(r, (0.0, 0.0)) for r in range(options.pp)) if options.dp > 1 else (),
            compute_factor=factor[0],
            compute_factor_from=factor[1],
            profiled_step_s=profiled_step(options, stages, microbatches, in_place),
            background_load=counted_background_load(front.cost_model.device.background_load, in_place),
            model_flops_per_step=flops,
            peak_flops=peak,
        ),
        provenance=_provenance(options, front, evaluation.objective_s, solver),
        zero=options.zero,
        sp=sp,
        tp_overlap=tp_overlap,
        graph_inputs=front.op_graph.graph.input_names,
        optimizer=options.optimizer,
        gpus_per_node=options.gpus_per_node,
        tied_parameters={p: tuple(s) for p, s in holders.items() if len(s) > 1},
        dtype=options.dtype,
        embedding_parameters=embedding_parameters(front.spec.module) if front.spec.module is not None else (),
        batch_statistics=batch_statistics_ops(front.op_graph.graph.module.graph),
    )


def with_solver(plan: Plan, solver: tuple[str, float, float]) -> Plan:
    """``plan`` (made by `plan_from_cuts`) as that call with another ``solver`` would have made it."""
    return replace(plan, provenance=replace(plan.provenance, solver_status=solver[0], bound_s=solver[1], gap=solver[2]))


def _provenance(options: CompileOptions, front: Front, objective_s: float, solver: tuple[str, float, float]) -> Provenance:
    """Where the plan came from: the model, the capture, the cost model, and the solver's status, bound and gap."""
    device = options.device  # a .toml by its absolute path: emit loads it again, from any folder
    if device.endswith(".toml"):
        device = str(Path(device).expanduser().resolve())
    return Provenance(
        model_file=str(front.spec.path.resolve()),
        model_sha256=front.spec.source_sha256,
        sources_sha256=front.spec.sources_sha256,
        capture=front.op_graph.graph.method,
        leaves=options.leaf,
        device=device,
        device_kind=front.cost_model.device.kind,
        cost_model=front.cost_model.name,
        solver_status=solver[0],
        objective_s=objective_s,
        bound_s=solver[1],
        gap=solver[2],
        autopart_version=autopart.__version__,
        torch_version=torch.__version__,
    )


def _overlapped(front: Front, blocks: range, received: set[str], sent: set[str], by_name: dict, tp: int
                ) -> dict[str, int]:
    """The stage's linears cut into pieces (``autopart.solve.overlap``), but those the stage's
    code does not cut: one that reads what the stage receives or makes what it sends (the code
    cuts a linear between the stage's own ops), and one that reads what another of the stage's
    blocks makes in another placement than a block boundary's (a final norm run whole): the code
    hands it on as its maker left it and gathers nothing for the linear. The blocks' times priced
    them cut: a block does not know the cuts (a Transformer's cuts pass only the residual stream,
    which no linear reads)."""
    if not front.shardings:
        return {}
    unlike = _unlike_boundaries(front, blocks, tp)
    kept = {}
    for k in blocks:
        for name, pieces in front.shardings[k].overlapped.items():
            inputs = {n.name for n in by_name[name].all_input_nodes}
            if name not in sent and received.isdisjoint(inputs) and all(unlike.get(n, k) == k for n in inputs):
                kept[name] = pieces
    return kept


def _unlike_boundaries(front: Front, blocks: range, tp: int) -> dict[str, int]:
    """The values that ``blocks`` make in another placement than they would cross a block boundary
    in, with the block that makes each."""
    return {name: k for k in blocks for name, strategy in front.shardings[k].strategies.items()
            if strategy.output != boundary_placement(front.op_graph, name, tp, front.shardings[k].sequence_parallel)}


def _stage_plans(front: Front, problem: PipelineProblem, ranges: list[range], recompute: list, tp: int
                 ) -> tuple[list[StagePlan], dict[str, list[int]]]:
    """Per stage its StagePlan, with the problem's figures (recompute included); and per
    parameter the stages that hold it (more than one: a tied weight). What a stage receives and
    sends is described as the ranks hold it (`autopart.passes.front.held_tensors`)."""
    chain = front.chain
    stage_nodes = [tuple(n for k in r for n in chain.blocks[k].nodes) for r in ranges]
    sends = stage_boundaries(front.op_graph, stage_nodes)
    metas = {name: cost.output for name, cost in front.op_graph.nodes.items()}
    graph_inputs = front.op_graph.graph.input_names
    holders: dict[str, list[int]] = {}
    block_times = block_seconds(front)
    placements = parameter_placements(front)
    fx_nodes = {n.name: n for n in front.op_graph.fx_nodes()}
    stages = []
    for s, r in enumerate(ranges):
        blocks = [chain.blocks[k] for k in r]
        parameters = tuple(dict.fromkeys(p for b in blocks for p in b.parameters))
        for p in parameters:
            holders.setdefault(p, []).append(s)
        read = batch_inputs(front.op_graph, stage_nodes[s], by_name=fx_nodes)
        needed = tuple(n for n in graph_inputs if n in read)
        times = [block_times[k] for k in r]
        strategies = {n: text for k in r for n, text in
                      (listed_strategies(front.shardings[k], front.op_graph, fx_nodes) if front.shardings else {}).items()}
        overlapped = _overlapped(front, r, set(sends[s - 1] if s > 0 else ()), set(sends[s] if s < len(sends) else ()),
                                 fx_nodes, tp)
        backward = sum(problem.block_time_s[k] for k in r) - sum(f for f, _, _ in times)  # recompute included
        stages.append(
            StagePlan(
                index=s,
                rank=problem.rank_of(s),
                blocks=(r.start, r.stop - 1),
                nodes=stage_nodes[s],
                inputs=held_tensors(front, ((n, metas[n]) for n in (sends[s - 1] if s > 0 else ())), r.start, tp),
                outputs=held_tensors(front, ((n, metas[n]) for n in (sends[s] if s < len(sends) else ())), r.stop, tp),
                batch_inputs=needed,
                parameters=parameters,
                forward_s=sum(f for f, _, _ in times),
                backward_s=backward,
                # a stage whose backward is all weight gradients (the embedding alone): equal, not a rounding apart
                backward_weight_s=min(backward, sum(w for _, _, w in times)),
                parameter_bytes=sum(chain.parameter_bytes[p] for p in parameters),
                activation_bytes=sum(problem.block_activation_bytes[k] for k in r),
                strategies=strategies,
                overlapped=overlapped,
                parameter_placements={p: str(placements[p]) for p in parameters if placements.get(p, REPLICATE) != REPLICATE},
                recompute=recompute[s].mode,
                no_grad_inputs=no_grad_values(front.op_graph, sends[s - 1] if s > 0 else ()),
            )
        )
    return stages, holders


def _message_bytes(stages: list[StagePlan]) -> int:
    """One microbatch's bytes between stages: each activation, and each gradient that comes back (`takes_gradient`)."""
    return sum(meta.nbytes * (1 + back) for before, after in zip(stages, stages[1:])
               for (_, meta), back in zip(before.outputs, takes_gradient(before.outputs, after.no_grad_inputs)))


def _model_flops(op_graph: OpGraph, global_batch_size: int) -> float:
    """The model's FLOPs of one step (forward and backward, without recompute's), from the ops'
    FLOPs at the annotated microbatch size: what MFU counts as useful work."""
    per_sample = sum(n.forward_flops + n.backward_flops for n in op_graph.nodes.values()) / op_graph.micro_batch_size
    return per_sample * global_batch_size


def _peak_flops(device: DeviceSpec, dtype: str) -> float:
    """The device's dense peak for the plan's matrix products: bf16, or fp32 (TF32 where the spec runs fp32 so)."""
    if dtype.startswith("bf16"):
        return device.peak_flops["bfloat16"]
    return device.peak_flops["tf32" if device.fp32_matmul_uses_tf32 else "float32"]


def _with_recompute(options: CompileOptions, front: Front, problem: PipelineProblem, ranges: list[range]):
    """The problem with every block in its stage's recompute mode, each recomputing stage's inputs
    held and what its recompute rebuilds in backward (the share one tensor-parallel rank holds,
    as the solver's problem counts it), so that evaluating the cuts gives the chosen stages' exact
    figures; and per stage its `RecomputeCost`."""
    modes = stage_modes(options.recompute, len(ranges))
    chain = front.chain
    layers = _checkpointed_layers(options, chain, [r for s, r in enumerate(ranges) if modes[s] == "full"])
    times, held, rebuilt = recompute_blocks(front, _block_modes(chain, modes, ranges, layers), layers, tp=options.tp)
    held, rebuilt = list(held), list(rebuilt)
    costs = []
    by_name = {n.name: n for n in front.op_graph.fx_nodes()}
    entering = layer_input_bytes(front, options.tp)
    for s, r in enumerate(ranges):
        inputs = stage_input_bytes(chain, r.start, r.stop - 1, by_name=by_name, held=entering[1:])
        own = checkpointed_layers(chain, r.start, r.stop - 1, layers, entering) if modes[s] == "full" else []
        costs.append(recompute_cost([chain.blocks[k] for k in r], modes[s], input_bytes=inputs, layers=own))
        if own:  # one layer rebuilt at a time, the stage's largest: on one block, so the stage's sum is it
            rebuilt[r.start] += layer_rebuilt_bytes(front, [(r.start + k.start, r.start + k.stop) for k, _ in own])
        elif modes[s] != "none":  # checkpoint keeps the stage's arguments
            held[r.start] += inputs
    layer_bytes = layered_parameters(chain, _local_bytes(options, front))[1]
    overhead = _overhead_bytes(options, front.cost_model.device, layer_bytes)  # the layers' rebuilds counted above
    return replace(problem, block_time_s=times, block_activation_bytes=tuple(held), overhead_bytes=overhead,
                   **_rebuilding(options, tuple(rebuilt), problem.microbatches)), costs


def _checkpointed_layers(options: CompileOptions, chain, ranges: list[range]) -> list[tuple[int, int]]:
    """The repeated layers (first, end blocks) that full recompute checkpoints one by one in the
    stages of ``ranges`` (those whose mode is full): each layer a stage holds whole, under a
    whole backward; none under a split one, whose stages rebuild whole (`autopart.runtime.forward`)."""
    if options.schedule in SPLIT_BACKWARD_KINDS:
        return []
    return [(first, end) for first, end, _ in layer_instances(chain)
            if any(r.start <= first and end <= r.stop for r in ranges)]


def _block_modes(chain, modes, ranges: list[range], layers: list[tuple[int, int]]) -> list[str]:
    """Per block, the mode it runs in: its stage's, but ``none`` outside the checkpointed layers of
    a stage that checkpoints layer by layer."""
    inside = {k for first, end in layers for k in range(first, end)}
    found = []
    for mode, r in zip(modes, ranges):
        layered = mode == "full" and any(k in inside for k in r)
        found += [("full" if k in inside else "none") if layered else mode for k in r]
    return found


def _overhead_bytes(options: CompileOptions, device: DeviceSpec, layer_bytes: int) -> int:
    """Per rank, what the mesh holds besides its stages: the framework's, the collective library's
    buffers, and at ZeRO-3 the gathered layers in flight."""
    nccl = communicator_bytes(device.kind, pp=options.pp, tp=options.tp, dp=options.dp, schedule=options.schedule)
    gathered = layers_in_flight_bytes(layer_bytes, dp=options.dp, zero=int(options.zero))
    return device.framework_overhead_bytes + nccl + gathered


def _rebuilding(options: CompileOptions, rebuilt: tuple[int, ...], microbatches: int) -> dict[str, tuple[int, ...]]:
    """``PipelineProblem``'s figures of what the stages' recompute rebuilds in backward: per block
    ``rebuilt``, per stage the microbatches whose backwards run at once; none without recompute."""
    if not any(rebuilt):
        return {"block_rebuilt_bytes": (), "rebuilt_at_once": ()}
    return {"block_rebuilt_bytes": rebuilt,
            "rebuilt_at_once": transient(options.schedule, options.pp, microbatches, options.chunks)}


def _weight_seeds(options: CompileOptions, front: Front, microbatches: int) -> dict[str, tuple[int, ...]]:
    """``PipelineProblem``'s figures of what a split backward keeps from I to W: per block the
    seeds, per stage the microbatches whose seeds live at once; none where the backward is whole."""
    pending = weight_pending(options.schedule, options.pp, microbatches, options.chunks)
    if not any(pending):
        return {"block_weight_seed_bytes": (), "weight_seeds_at_once": ()}
    return {"block_weight_seed_bytes": block_weight_seeds(front), "weight_seeds_at_once": pending}


def _state_bytes(options: CompileOptions, parameter_bytes: int, *, layered: bool, frozen: bool) -> int:
    """Weights, gradients and optimizer state of one rank's share of a parameter."""
    return state_bytes(parameter_bytes, optimizer=options.optimizer, dp=options.dp, zero=options.zero,
                       dtype=options.dtype or "fp32", layered=layered, frozen=frozen)


def _local_bytes(options: CompileOptions, front: Front) -> dict[str, int]:
    """Per parameter, its bytes on one rank of the tensor-parallel group."""
    placements = parameter_placements(front)
    return {name: nbytes // (options.tp if placements.get(name, REPLICATE).kind == "S" else 1)
            for name, nbytes in front.chain.parameter_bytes.items()}


def layered_parameters(chain, local: dict[str, int]) -> tuple[frozenset[str], int]:
    """The parameters of the chain's repeated layers (each layer its own FSDP unit at ZeRO-3,
    `autopart.predict.memory`), and the largest layer's bytes of ``local`` (a parameter's share
    on one tensor-parallel rank)."""
    instances = layer_parameters(chain)
    return frozenset().union(*instances), max((sum(local[p] for p in ps) for ps in instances), default=0)
