"""One rank of tests/test_buffer_updates.py's check of a loop of one's own over torch's
schedules (`autopart.runtime.pipelining`): it trains the compiled plan in OUT for STEPS steps of
SGD at rate LR (0.1 if not given) and prints the buffers its stages end with, as ``buffers {json}``,
then evaluates one batch with ``schedule.eval`` and prints them again.

``--weights-after-next-forward``: each weight-gradient action (W) of a zero-bubble schedule that
its stage's next action, a forward, would follow runs after that forward instead, as a schedule
of one's own may order them (torch's own orders run each W before its stage's next F); prints
``delayed N``, the Ws moved."""

import itertools
import json
import sys

import torch
import torch.distributed as dist

from autopart.runtime.pipelining import build_stages


def weights_after_next_forward(order: dict) -> tuple[dict, int]:
    """``order`` with each W moved after its stage's next action where that is an F."""
    moved = 0
    reordered = {}
    for rank, actions in order.items():
        actions = [a for a in actions if a is not None]
        position = 0
        while position < len(actions):
            action = actions[position]
            later = [j for j in range(position + 1, len(actions)) if actions[j].stage_index == action.stage_index]
            if action.computation_type.value == "W" and later and actions[later[0]].computation_type.value == "F":
                actions.insert(later[0], actions.pop(position))
                moved += 1
                continue  # the action now at ``position`` was after it
            position += 1
        reordered[rank] = actions
    return reordered, moved


arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
out, steps, lr = arguments[0], int(arguments[1]), float(arguments[2]) if len(arguments) > 2 else 0.1
dist.init_process_group("gloo")
try:
    pipeline = build_stages(out)
    schedule = pipeline.schedule()
    if "--weights-after-next-forward" in sys.argv:
        order, moved = weights_after_next_forward(schedule.pipeline_order)
        schedule.pipeline_order = order
        schedule._prepare_schedule_with_comms(order)  # torch's lowering of a compute-only order (its _load_csv's)
        print(f"delayed {moved}", flush=True)
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
