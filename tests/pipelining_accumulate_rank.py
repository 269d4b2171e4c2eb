"""One rank of tests/test_pipelining.py's check of gradients accumulated over several
``schedule.step`` calls before one optimizer step: it runs STEPS steps of train.py's batches of
OUT, each with ``reduce_gradients`` (REDUCE ``each``) or with one after the last (``once``), zeroes the gradients in place (``zero_grad(set_to_none=False)``),
runs STEPS more, and prints what the gradients hold, by the original model's names, as ``grads
{json}`` (the replica 0 of each pipeline rank). First it prints torch's ``scale_grads``
refused, as ``refused MESSAGE``: it would divide the accumulated gradients again."""

import itertools
import json
import sys

import torch.distributed as dist

from autopart.ir.errors import ConfigError
from autopart.runtime.pipelining import build_stages

out, steps, reduce = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
try:
    pipeline = build_stages(out)
    try:
        pipeline.schedule(scale_grads=True)
    except ConfigError as error:
        print(f"refused {error}", flush=True)
    schedule = pipeline.schedule()
    batches = pipeline.batches()
    for _ in range(2):
        for p in pipeline.parameters():
            if p.grad is not None:
                p.grad.zero_()
        for inputs, target in itertools.islice(batches, steps):
            schedule.step(**pipeline.step_inputs(inputs, target), losses=[], return_outputs=False)
            if reduce == "each":
                pipeline.reduce_gradients()
        if reduce == "once":
            pipeline.reduce_gradients()
    if pipeline.coordinates.dp == 0:
        print("grads " + json.dumps({name: p.grad.tolist() for name, p in pipeline.named_parameters()}), flush=True)
finally:
    dist.destroy_process_group()
