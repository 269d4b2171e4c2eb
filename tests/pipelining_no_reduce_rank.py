"""One rank of tests/test_pipelining.py's check of a loop over torch's schedules that never calls
``reduce_gradients`` (at dp 1, without tied weights or updated buffers, it has nothing to do)
nor steps an optimizer: it runs train.py's first STEPS batches of OUT and prints each step's
mean loss on the last stage as ``loss X``."""

import itertools
import sys

import torch
import torch.distributed as dist

from autopart.runtime.pipelining import build_stages

out, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
try:
    pipeline = build_stages(out)
    schedule = pipeline.schedule()
    for inputs, target in itertools.islice(pipeline.batches(seed=0), steps):
        losses: list[torch.Tensor] = []
        schedule.step(**pipeline.step_inputs(inputs, target), losses=losses, return_outputs=False)
        if pipeline.is_last:
            print(f"loss {torch.stack(losses).double().mean().item()!r}", flush=True)
finally:
    dist.destroy_process_group()
