"""Write the output directory of a compile: plan, stage programs, weights, entry point, report.

The directory is written beside its destination and renamed into place at the end, so that a
failure never leaves a half-written output directory behind.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from autopart.passes.annotate import OpGraph
from autopart.ir.model_file import ModelSpec, files_beside, is_meta
from autopart.codegen.names import plain_text
from autopart.ir.errors import ConfigError
from autopart.codegen.output_dir import check_files_beside, check_output_directory, remove_output, write_marker
from autopart.codegen.report import begin_report, report_forks
from autopart.codegen.tensor_parallel import overlapped_shapes, shard_stage_graph
from autopart.codegen.layers import repeated_units, stage_units
from autopart.codegen.stage_file import stage_source
from autopart.codegen.stages import describe_tensors, stage_graphs
from autopart.ir.placement import shard
from autopart.ir.plan import Plan
from autopart.ir.tensors import PRECISION_TEXT
from autopart.runtime.launch import PLAN_HASH_KEY, file_sha256, plan_digest
from autopart.runtime.output_paths import as_umask, save_tensors
from autopart.runtime.shards import shard_weight
from autopart.runtime.shards import weights_file_name
from autopart.runtime.torchrun_command import plan_launch
from autopart.passes.blocks import BlockChain, build_blocks
from autopart.solve.sharding import REPLICATE, Placement, Strategy, local_shape
from autopart.solve.sharding_rules import strategies

__all__ = ["emit_directory", "check_output_directory"]


def emit_directory(plan: Plan, op_graph: OpGraph, spec: ModelSpec, out_dir: Path, chain: BlockChain | None = None) -> Path:
    """Write ``plan``'s output directory, whole or not at all. ``chain``: ``op_graph``'s blocks,
    where the caller has them (cutting a model of a thousand layers again takes seconds)."""
    out_dir = Path(out_dir)
    check_output_directory(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # a folder of our own beside the destination (so the rename stays on one file system): removing
        # it whole on a failure removes nothing that autopart did not write
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    except OSError as exc:
        raise ConfigError(f"cannot write the output directory '{out_dir}' ({exc.strerror}); choose a path for -o "
                          "where you may create folders") from None
    try:
        _write(plan, op_graph, spec, staging, final=out_dir, chain=build_blocks(op_graph) if chain is None else chain)
        write_marker(staging)
        remove_output(out_dir)
        as_umask(staging).rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _write(plan: Plan, op_graph: OpGraph, spec: ModelSpec, out: Path, *, final: Path, chain: BlockChain) -> None:
    (out / "stages").mkdir(parents=True)
    (out / "weights").mkdir()
    # beside the rest where it is large: it reads nothing that the stage files' hashes add
    report = begin_report(plan, out, fork=report_forks(plan))
    try:
        _write_programs(plan, op_graph, spec, out, final=final, chain=chain)
        report.wait()
    finally:
        report.stop()


def _write_programs(plan: Plan, op_graph: OpGraph, spec: ModelSpec, out: Path, *, final: Path,
                    chain: BlockChain) -> None:
    """Everything but the report: the stage programs, plan.json, the weights, model.py, train.py."""
    module = op_graph.graph.module
    tensors: dict[str, torch.Tensor] = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    for node in module.graph.nodes:
        if node.op == "get_attr":
            value = module
            for part in str(node.target).split("."):
                value = getattr(value, part)
            tensors[str(node.target)] = value
    tensors.update({name: value for name, value in op_graph.graph.built_buffers.items() if name in tensors})
    # a model built on the meta device has no values to write: each rank makes its own weights
    # with the model's initialisers, or reads them from a checkpoint (train.py --weights)
    materialised = not is_meta(module)
    graphs = stage_graphs(op_graph, [stage.nodes for stage in plan.stages])
    train_py = plain_text(str(final / "train.py"))  # the commands are lines of docstrings
    command = plan_launch(plan, train_py, "--steps 10").block("    ", gap=True)
    tp = plan.mesh["tp"]
    leaf_names = {str(n.target): list(op_graph.leaf_tensors[n.name]) for n in module.graph.nodes if n.op == "call_module"}

    shards: dict[tuple, torch.Tensor] = {}  # a meta model's by shape: its layers' are alike, and each slice costs

    def local(name: str, placements: dict[str, Placement], rank: int) -> torch.Tensor:
        tensor, placement = tensors[name], placements.get(name, REPLICATE)
        if not tensor.is_meta:
            return shard_weight(tensor.detach(), placement, tp, rank)
        key = (tuple(tensor.shape), tensor.dtype, placement, rank)  # all a meta tensor's slice is
        if key not in shards:
            shards[key] = shard_weight(tensor.detach(), placement, tp, rank)
        return shards[key]

    layers = repeated_units(chain)
    held: list[tuple[int, dict[str, Placement], list[str]]] = []  # per stage: what its weights files hold
    for stage_plan, stage in zip(plan.stages, graphs):
        placements = {name: Placement.parse(p) for name, p in stage_plan.parameter_placements.items()}
        chosen = _stage_strategies(stage, stage_plan, op_graph) if tp > 1 else {}
        boundary = {name: shard(meta.split_dim) for name, meta in (*stage_plan.inputs, *stage_plan.outputs)
                    if meta.split_dim is not None}
        shapes = _local_shapes(stage, chosen, op_graph, tp, boundary)  # before sharding: the graph is rewritten in place
        if tp > 1:
            stage = shard_stage_graph(stage, strategies=chosen, parameters=placements, op_graph=op_graph, tp=tp,
                                      overlapped=stage_plan.overlapped, boundary=boundary)
            shapes = overlapped_shapes(stage, shapes, tp)
        header = _stage_docstring(plan, stage_plan.index, stage, op_graph, command)
        declared = {name: local(name, placements, 0) for name in (*stage.parameters, *stage.buffers, *stage.constants)}
        units = stage_units(stage.graph, stage_plan.nodes, layers, op_graph, spec.module)
        source = stage_source(stage, stages=len(plan.stages), op_graph=op_graph, metas=declared, header=header,
                              units=units, shapes=shapes)  # fmt: skip
        (out / "stages" / f"stage_{stage.index}.py").write_text(source)
        names = [*stage.parameters, *stage.buffers, *(n for leaf in stage.leaves for n in leaf_names[leaf])]
        held.append((stage.index, placements, [*stage.constants, *(names if materialised else ())]))
    sources = sorted(p.relative_to(out).as_posix() for p in (out / "stages").iterdir())
    plan = replace(plan, stage_sha256={name: file_sha256(out / name) for name in sources})  # checked by every rank
    plan.save(out / "plan.json")
    compile_id = {PLAN_HASH_KEY: plan_digest(out / "plan.json")}  # checked at launch: weights match the plan
    for index, placements, names in held:
        for rank in range(tp):  # written even when empty (a meta model's ranks make their weights): it
            weights = {name: local(name, placements, rank).contiguous().clone() for name in names}  # carries the plan's hash
            save_tensors(weights, out / "weights" / weights_file_name(index, rank, tp), compile_id)
    shutil.copyfile(spec.path, out / "model.py")
    _copy_files_beside(spec, out)
    (out / "train.py").write_text(_entry_point(plan, command))


def _copy_files_beside(spec: ModelSpec, out: Path) -> None:
    """The modules the model file imports from its folder, beside OUT/model.py (`files_beside`):
    the output directory trains wherever it is copied to, and train.py puts its folder first on
    the path, as the compile put the model's."""
    check_files_beside(spec)  # the compile said so before its work; an emit of a plan alone says so here
    for relative, source in files_beside(spec).items():
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def _stage_strategies(stage, stage_plan, op_graph: OpGraph) -> dict[str, Strategy]:
    """The plan's strategy of every tensor op of the stage; those it does not list are replicated."""
    chosen = {name: Strategy.parse(text) for name, text in stage_plan.strategies.items()}
    for node in stage.graph.nodes:
        cost = op_graph.nodes.get(node.name)
        if node.op in ("call_function", "call_method") and node.name not in chosen and cost is not None:
            chosen[node.name] = strategies(node, op_graph, 1)[0]
    return chosen


def _local_shapes(stage, strategies: dict[str, Strategy], op_graph: OpGraph, tp: int,
                  boundary: dict[str, Placement]) -> dict[str, tuple]:
    """Per tensor of the stage, the (shape, dtype) one rank holds: the local one under tensor
    parallelism (a received value split over the sequence: its slice)."""
    shapes = {}
    for node in stage.graph.nodes:
        cost = op_graph.nodes.get(node.name)
        if cost is None or cost.output is None or node.op in ("get_attr", "output"):
            continue
        strategy = strategies.get(node.name)
        placement = strategy.output if strategy is not None else boundary.get(node.name, REPLICATE)
        shapes[node.name] = (local_shape(cost.output.shape, placement, tp), cost.output.dtype)
    return shapes


def _stage_docstring(plan: Plan, index: int, stage, op_graph: OpGraph, command: str) -> str:
    stage_plan = plan.stages[index]
    paths = [op_graph.nodes[n].module_path for n in stage_plan.nodes if op_graph.nodes[n].module_path]
    span = plain_text(f"{paths[0]} to {paths[-1]}") if paths else "no module"
    last = index == len(plan.stages) - 1
    tp = plan.mesh["tp"]
    return f'''"""Stage {index} of {len(plan.stages)} of {plain_text(Path(plan.provenance.model_file).name)}, generated by autopart.

Blocks {stage_plan.blocks[0]} to {stage_plan.blocks[1]} ({span}{", and the loss" if last else ""}), on pipeline rank {stage_plan.rank}.
Predicted per microbatch: forward {stage_plan.forward_s * 1e3:.3f} ms, backward {stage_plan.backward_s * 1e3:.3f} ms.
{_how_it_runs(plan.dtype, stage_plan.recompute)}
Receives: {describe_tensors(stage.inputs, op_graph, dict(stage_plan.inputs), tp)}
Reads from the batch: {", ".join(stage.batch_inputs) or "nothing"}
Sends: {"the loss" if last else describe_tensors(stage.outputs, op_graph, dict(stage_plan.outputs), tp)}

Tensors keep their names in the original model, so weights and checkpoints map back by name.
Train with{command}
"""'''


_RECOMPUTE = {
    "none": "autograd keeps every activation for backward",
    "selective": "selective recompute: torch.utils.checkpoint keeps the outputs of matmuls and attention and runs the rest again in backward",
    "full": ("full recompute: torch.utils.checkpoint keeps the inputs of each layer method (of the stage, under a "
             "zero-bubble schedule or without one) and runs it again in backward"),
    "stage": "stage recompute: torch.utils.checkpoint keeps the stage's inputs and runs its forward again in backward",
}


def _how_it_runs(dtype: str, recompute: str) -> str:
    """One line of the stage docstring: the precision and recompute that autopart.runtime.forward applies."""
    precision = f"Runs under {PRECISION_TEXT[dtype]}" if dtype != "fp32" else "Runs in fp32"
    return f"{precision}; {_RECOMPUTE[recompute]} (autopart/runtime/forward.py)."


def _entry_point(plan: Plan, command: str) -> str:
    schedule = plan.schedule
    return f'''"""Train {plain_text(Path(plan.provenance.model_file).name)} on {plan.world_size} processes, generated by autopart.

Plan: {len(plan.stages)} pipeline stages, {schedule.kind} schedule, {schedule.microbatches} microbatches of
{schedule.micro_batch_size} (global batch {schedule.global_batch_size}); predicted step {plan.predicted.step_s * 1e3:.2f} ms,
bubble {plan.predicted.bubble:.1%}. Precision {plan.dtype}; recompute per stage: {", ".join(s.recompute for s in plan.stages)}.

Run it{command}

(For nodes of another size, compile with --gpus-per-node G: it prints the command for each node.)

The training recipe, checkpoints and metrics: python train.py --help.
(NCCL when CUDA is present, gloo otherwise.)
"""

import sys
from pathlib import Path

from autopart.runtime.allocator import prefer_expandable_segments

prefer_expandable_segments()  # before torch is imported: the CUDA allocator reads it once, as it starts
from autopart.runtime.train import leave, main  # noqa: E402

if __name__ == "__main__":
    main(Path(__file__).resolve().parent, sys.argv[1:])
    leave()  # exit handlers run, the interpreter's teardown (where gloo can abort a finished run) does not
'''
