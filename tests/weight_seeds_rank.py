"""One rank of tests/test_weight_seeds.py's tensor-parallel check: each stage but the first of a
compiled plan runs its forward and its split backward's input half (I) on this rank's shards, and
the rank prints, per stage, the bytes that I keeps for W."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autopart.ir.model_file import load_model_file
from autopart.ir.plan import load_plan
from autopart.ir.scatter_gather import held_shape
from autopart.runtime import collectives as tp
from autopart.runtime.backward import backward_input
from autopart.runtime.forward import StageForward
from autopart.runtime.stage import load_stage

dist.init_process_group("gloo")
rank, t = dist.get_rank(), dist.get_world_size()
tp.set_group(dist.group.WORLD)
out, model, micro_batch_size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
plan = load_plan(out / "plan.json")
example_inputs, example_target = load_model_file(model).example(micro_batch_size)
example = dict(zip(plan.graph_inputs, (*example_inputs, example_target)))
cpu = torch.device("cpu")
kept_bytes = {}
for stage in plan.stages[1:]:
    torch.manual_seed(stage.index)  # the same inputs on every rank of the group, as a stage receives them
    module = load_stage(out, stage.index, cpu, tp_rank=rank, tp=t, placements=stage.parameter_placements)
    inputs = [torch.randn(held_shape(meta, t), dtype=getattr(torch, meta.dtype)).requires_grad_()
              for _, meta in stage.inputs if getattr(torch, meta.dtype).is_floating_point]
    batch = [example[name] for name in stage.batch_inputs]
    forward = StageForward(module, recompute="none", dtype=plan.dtype, device=cpu, split_backward=True)
    forward.begin_step()
    result, _ = forward(*inputs, *batch)
    outputs = list(result) if isinstance(result, tuple) else [result]
    grads = [torch.randn_like(o) for o in outputs]
    _, pending = backward_input(outputs, grads, inputs, list(module.parameters()))
    kept = {g.untyped_storage()._cdata: g.untyped_storage().nbytes() for group in pending.groups
            for seeds in group.kept.values() for g in seeds if g is not None}  # each storage once
    kept_bytes[stage.index] = sum(kept.values())
print("kept", rank, json.dumps(kept_bytes), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # as tests/sp_collectives_rank.py: the test is not of torch's C++ teardown
