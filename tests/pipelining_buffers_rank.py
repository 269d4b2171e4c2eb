"""One rank of tests/test_buffer_updates.py's check of a loop of one's own over torch's
schedules (`autopart.runtime.pipelining`): it trains the compiled plan in OUT for STEPS steps of
SGD at rate LR (0.1 if not given) and prints the buffers its stages end with, as ``buffers {json}``,
then evaluates one batch with ``schedule.eval`` and prints them again."""

import itertools
import json
import sys

import torch
import torch.distributed as dist

from autopart.runtime.pipelining import build_stages

out, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
dist.init_process_group("gloo")
try:
    pipeline = build_stages(out)
    schedule = pipeline.schedule()
    optimizer = torch.optim.SGD(pipeline.parameters(), lr=lr)
    for inputs, target in itertools.islice(pipeline.batches(seed=0), steps):
        schedule.step(**pipeline.step_inputs(inputs, target), losses=[], return_outputs=False)
        pipeline.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for _ in range(2):  # after training, and after an evaluation, which must leave them
        buffers = {name: b.tolist() for module in pipeline.modules.values() for name, b in module.named_buffers()}
        print("buffers " + json.dumps(buffers), flush=True)
        schedule.eval(**pipeline.step_inputs(inputs, target), losses=[], return_outputs=False)
finally:
    dist.destroy_process_group()
