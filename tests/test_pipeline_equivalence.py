"""The first test of every feature: the generated programs, run as ranks with gloo, give the same
losses and final parameters as a single-process run of the same batches. The ranks are started
as torchrun starts them (``tests.distributed.run_ranks``); the AdamW case goes through torchrun
itself."""

import pytest

from tests.distributed import assert_same_training, compile_and_train

pytestmark = pytest.mark.multiprocess


# Every pair of the four choices' values (example, pp, schedule, microbatches per stage) in one
# case at least, and the quickstart's layout: the sixteen cases of every combination ran each
# runtime path several times over (the schedules each have their own tests beside these).
@pytest.mark.parametrize("example, pp, schedule, microbatch_factor", [
    ("gpt", 2, "gpipe", 1), ("gpt", 4, "1f1b", 2), ("llama", 2, "1f1b", 2), ("llama", 4, "gpipe", 2),
    ("llama", 4, "1f1b", 1), ("gpt", 2, "1f1b", 2),
])  # fmt: skip
def test_pipeline_trains_like_one_process(tmp_path, example, pp, schedule, microbatch_factor):
    run = compile_and_train(tmp_path, example, pp=pp, microbatches=pp * microbatch_factor, schedule=schedule)
    assert len(run.plan.stages) == pp
    if example == "gpt":  # tied input embedding and output head: held by the first and last stage
        assert run.plan.tied_parameters == {"wte.weight": (0, pp - 1)}
    assert_same_training(run, optimizer="sgd", lr=0.1)


def test_adamw_trains_like_one_process(tmp_path):
    run = compile_and_train(tmp_path, "gpt", pp=2, microbatches=4, schedule="1f1b", optimizer="adamw", lr=1e-3,
                           launcher="torchrun")
    # Adam divides by sqrt(v): an element whose gradient is at float-noise level (~1e-9) moves by a
    # noisy fraction of one step, so parameters agree to 1% of a step (lr * 1e-2), not to 1e-6.
    assert_same_training(run, optimizer="adamw", lr=1e-3, param_atol=1e-5)
