"""A training loop of your own, written against torch.distributed.pipelining, running an autopart plan.

    autopart compile examples/gpt.py -o out --pp 2 --microbatches 4 --schedule 1f1b
    torchrun --nproc-per-node 2 examples/pipelining_loop.py out --steps 10

Every rank builds its stages of the plan (`autopart.runtime.pipelining.build_stages`), takes the
plan's torch schedule class, and steps it on the batches that ``out/train.py`` would draw, with
the same optimizer: the losses it prints are ``train.py``'s. Replace the loop's body with your
own (another optimizer, your data, logging): the stages and the schedule are torch's own objects.

To continue a run from step N's weights (a whole-model safetensors file, as ``autopart
consolidate`` writes), give ``--weights FILE --first-step N``: the loop then draws step N's
batch and dropout first, as ``train.py --resume`` does (it starts the optimizer afresh: with
SGD, whose only state is the weights, the losses are those of the uninterrupted run).

To accumulate gradients over K batches before one optimizer step, run ``schedule.step`` and
``pipeline.reduce_gradients()`` for each (the gradients add up, as ``loss.backward()``'s do), then
divide them by K (``p.grad.div_(K)``) for their mean before ``optimizer.step()``.
This file is a script, not a model file: it defines no ``build_model``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from autopart.runtime.pipelining import build_stages
from autopart.runtime.device import backend, compute_device
from autopart.runtime.recipe import parameter_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="an output directory of autopart compile")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw", help="as train.py --optimizer")
    parser.add_argument("--weight-decay", type=float,
                        help="as train.py --weight-decay (default: the optimizer's, AdamW 0.01, SGD 0)")
    parser.add_argument("--seed", type=int, default=0, help="of the training batches and dropout draws, as train.py --seed")
    parser.add_argument("--weights", type=Path, help="a safetensors file of the whole model to start from")
    parser.add_argument("--first-step", type=int, default=0, help="the steps --weights were trained for")
    args = parser.parse_args()

    device = compute_device()
    dist.init_process_group(backend(device))
    try:
        pipeline = build_stages(args.out, device=device, seed=args.seed, weights=args.weights, first_step=args.first_step)
        schedule = pipeline.schedule()
        # train.py's optimizer on a CPU (one tensor at a time), decaying what train.py decays
        groups = parameter_groups(pipeline.named_parameters(), weight_decay=args.weight_decay,
                                  embeddings=pipeline.plan.embedding_parameters)
        if args.optimizer == "sgd":
            optimizer = torch.optim.SGD(groups, lr=args.lr, foreach=False)
        else:
            optimizer = torch.optim.AdamW(groups, lr=args.lr, foreach=False)
        for step, (inputs, target) in zip(range(args.first_step, args.steps), pipeline.batches(args.seed)):
            losses: list[torch.Tensor] = []
            schedule.step(**pipeline.step_inputs(inputs, target), losses=losses, return_outputs=False)
            pipeline.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if pipeline.is_last:
                loss = torch.stack(losses).double().mean().reshape(1)
                if pipeline.groups.dp is not None:
                    dist.all_reduce(loss, group=pipeline.groups.dp)
                if pipeline.coordinates.dp == 0 and pipeline.coordinates.tp == 0:
                    print(f"step {step} loss {loss.item() / pipeline.plan.mesh['dp']:.6f}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
