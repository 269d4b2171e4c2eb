"""One rank of tests/test_pipelining.py's check of ``schedule.eval`` between the steps of a
loop of one's own over torch's schedules (`autopart.runtime.pipelining`): it trains the compiled
plan in OUT for STEPS steps of SGD at rate LR, and after each step evaluates train.py's held-out
batch (``--eval-batches 1``, seed 0) as ``train.py --eval-every 1`` does. It prints, on the last
stage's first replica, each evaluation's mean loss as ``eval_loss X``; per evaluation on every
rank, the most copies of the updated buffers alive at once as ``copies N of T`` (T: the buffers
tracked) and whether it left a forward's autograd graph behind as ``graph kept B``; then the
buffers its stages end with, as ``buffers {json}``."""

import itertools
import json
import sys
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from autopart.ir.model_file import load_model_file
from autopart.runtime.data import eval_batches, model_file
from autopart.runtime.pipelining import build_stages


class BufferCopies(TorchFunctionMode):
    """Counts the copies of the given buffers alive at once (a clone of a tensor sharing their memory)."""

    def __init__(self, buffers: list[torch.Tensor]):
        super().__init__()
        self.addresses = {b.data_ptr() for b in buffers}
        self.alive: list[weakref.ref] = []
        self.most = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.clone and args[0].data_ptr() in self.addresses:
            self.alive = [ref for ref in self.alive if ref() is not None] + [weakref.ref(result)]
            self.most = max(self.most, len(self.alive))
        return result


out, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo")
try:
    pipeline = build_stages(out)
    schedule = pipeline.schedule()
    optimizer = torch.optim.SGD(pipeline.parameters(), lr=lr)
    spec = load_model_file(model_file(pipeline.out_dir, pipeline.plan), build=False)
    held_out = list(eval_batches(spec, pipeline.plan.schedule.global_batch_size, 0, 1))
    tracked = [b for updates in pipeline.updates for b in updates.tracked_buffers()]
    for inputs, target in itertools.islice(pipeline.batches(seed=0), steps):
        schedule.step(**pipeline.step_inputs(inputs, target), losses=[], return_outputs=False)
        pipeline.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with BufferCopies(tracked) as copies:
            for held_inputs, held_target in held_out:
                schedule.eval(**pipeline.step_inputs(held_inputs, held_target), losses=losses, return_outputs=False)
        print(f"copies {copies.most} of {len(tracked)}", flush=True)
        kept = any(t.requires_grad for stage in pipeline.stages for outputs, _ in stage.fwd_cache.values()
                   for t in outputs if isinstance(t, torch.Tensor))
        print(f"graph kept {kept}", flush=True)
        if pipeline.is_last:  # the mean over the replicas, as train.py's
            loss = torch.stack(losses).double().mean().reshape(1) / pipeline.plan.mesh["dp"]
            if pipeline.groups.dp is not None:
                dist.all_reduce(loss, group=pipeline.groups.dp)
            if pipeline.coordinates.dp == 0 and pipeline.coordinates.tp == 0:
                print(f"eval_loss {loss.item()!r}", flush=True)
    buffers = {name: b.tolist() for module in pipeline.modules.values() for name, b in module.named_buffers()}
    print("buffers " + json.dumps(buffers), flush=True)
finally:
    dist.destroy_process_group()
