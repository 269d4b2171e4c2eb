"""Activation recompute and bf16 autocast in the generated programs, under torchrun with gloo.

Recompute changes when activations are computed, never what: the programs train exactly like
one process, as without it. Each launch mixes modes per stage, so that two launches run both
modes on both the first stage (token ids in, no input gradient) and the last (the loss), through
a whole backward (1F1B: torch.utils.checkpoint recomputes) and a split one (ZB-H1: the stage
rebuilds its graph once at I, for I and W). bf16 is compared with a single-process bf16 run, on
a model whose stages send each other bf16 activations and gradients (tests/models/tanh_mlp.py).
"""

import pytest
import torch

from autopart.runtime.reference import initial_weights, train_reference
from tests.distributed import REPO, assert_same_training, compile_and_train

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "schedule, recompute", [("1f1b", ("full", "selective")), ("zb-h1", ("selective", "full"))], ids=["1f1b", "zb-h1"]
)
def test_recompute_trains_like_one_process(tmp_path, schedule, recompute):
    run = compile_and_train(tmp_path, "gpt", pp=2, microbatches=4, schedule=schedule, recompute=recompute,
                            steps=2, micro_batch_size=1)  # fmt: skip
    assert tuple(s.recompute for s in run.plan.stages) == recompute
    assert_same_training(run, optimizer="sgd", lr=0.1)


# bf16 keeps 8 bits of mantissa: one rounding is up to 2**-8 = 0.4% of a value. The pipeline and
# one process round at other places: each microbatch's weight gradient is rounded to bf16 before
# the fp32 sum over microbatches, and matrix products of another batch size may sum otherwise.
# So the losses are held to torch.testing's bf16 tolerance (rtol 1.6e-2, about four roundings),
# and each parameter to 2% (five roundings) of how far training moved it; measured, they differ
# by at most 0.53% of it. The first loss, computed from the same weights by the same forward in
# the same dtypes, agrees to float noise (4e-8 measured), while the fp32 model's is 2.5e-5 away:
# that tells a bf16 program from an fp32 one.
BF16_RTOL, BF16_LOSS_ATOL, BF16_SHARE_OF_STEP = 1.6e-2, 1e-5, 2e-2


@pytest.mark.parametrize("recompute", [("none", "selective"), ("full", "full")], ids=["none-selective", "full"])
def test_bf16_trains_like_one_bf16_process(tmp_path, recompute):
    """With full recompute each stage checkpoints its layer methods one by one: each layer's
    recompute casts the step's bf16 working weights again (one of them tied across the stages)."""
    run = compile_and_train(tmp_path, REPO / "tests" / "models" / "tanh_mlp.py", pp=2, microbatches=4,
                            schedule="1f1b", dtype="bf16", recompute=recompute, steps=2)  # fmt: skip
    assert all("layer_methods" in (run.out / "stages" / f"stage_{s}.py").read_text() for s in range(2))
    assert run.plan.dtype == "bf16"
    assert [meta.dtype for _, meta in run.plan.stages[1].inputs] == ["bfloat16"]  # bf16 crosses, both ways
    reference = train_reference(run.out, steps=run.steps, lr=0.1, optimizer="sgd")
    fp32 = train_reference(run.out, steps=run.steps, lr=0.1, optimizer="sgd", dtype="fp32")
    losses = torch.tensor([m["loss"] for m in run.metrics], dtype=torch.float64)
    torch.testing.assert_close(losses, torch.tensor(reference.losses, dtype=torch.float64),
                               rtol=BF16_RTOL, atol=BF16_LOSS_ATOL)  # fmt: skip
    assert abs(losses[0] - reference.losses[0]) < 1e-6 < 5e-6 < abs(losses[0] - fp32.losses[0])
    initial = initial_weights(run.out)
    for stage, weights in run.finals.items():
        for name, value in weights.items():
            assert value.dtype == torch.float32, f"{name}: the master weights stay fp32"
            step = (reference.parameters[name] - initial[name]).abs().max().item()
            torch.testing.assert_close(value, reference.parameters[name], rtol=0, atol=BF16_SHARE_OF_STEP * step + 1e-7,
                                       msg=name)  # fmt: skip
    for name, holders in run.plan.tied_parameters.items():  # summed in fp32: the copies stay equal
        copies = [run.finals[s][name] for s in holders]
        assert all(torch.equal(copy, copies[0]) for copy in copies[1:]), name
