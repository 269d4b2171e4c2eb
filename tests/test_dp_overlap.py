"""The data-parallel all-reduce overlapped with the backward (`autopart.runtime.reducer`): the
same training as one process under dp 2 and pp 2 x dp 2 (1F1B and ZB-H1, tied embedding and
head), and buckets launched while the backward still runs, in the order the rule says."""

import json

import pytest

from autopart.ir.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, final_gradient_positions, plan_buckets
from autopart.ir.actions import Kind
from autopart.schedule import Action, add_communication, build_schedule
from tests.distributed import FREE_LINKS, REPO, assert_same_training, compile_and_train


def test_buckets_follow_the_backward_and_never_span_stages():
    megabyte = 1 << 20
    # stage 3 becomes final first: its last parameter opens the first (1 MiB) bucket
    buckets = plan_buckets([(3, [("a", megabyte // 2), ("b", megabyte // 2), ("c", megabyte)]),
                            (1, [("d", 30 * megabyte), ("e", 10 * megabyte), ("f", 20 * megabyte)])])
    assert [(b.stage, b.names) for b in buckets] == [(3, ("c",)), (3, ("b", "a")), (1, ("f", "e")), (1, ("d",))]
    assert buckets[0].nbytes == FIRST_BUCKET_BYTES and buckets[2].nbytes >= BUCKET_BYTES


@pytest.mark.parametrize("kind, chunks, final", [("1f1b", 1, {0: "0B3"}), ("zb-h1", 1, {0: "0W3"}),
                                                  ("interleaved", 2, {0: "0B3", 2: "2B3"})])
def test_a_stage_is_final_after_its_last_weight_gradient_action(kind, chunks, final):
    actions = add_communication(build_schedule(kind, ranks=2, microbatches=4, chunks=chunks), ranks=2)[0]
    positions = final_gradient_positions(actions)
    assert {s: str(actions[p]) for s, p in positions.items()} == final


def _bucket_launches(folder) -> list[tuple[list[float], float]]:
    """Per rank and step: when each bucket was launched, and when the rank's last compute action ended."""
    found = []
    for file in sorted(folder.glob("rank_*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            last = max(end for name, _, end, _ in record["actions"] if Action.parse(name).is_compute)
            found.append((record["buckets"], last))
    return found


@pytest.mark.multiprocess
def test_data_parallel_reduces_while_the_backward_runs(tmp_path):
    run = compile_and_train(tmp_path, REPO / "tests" / "models" / "wide_gpt.py", pp=1, microbatches=2,
                            schedule="1f1b", dp=2, global_batch_size=8, device=str(FREE_LINKS),
                            train_args=("--action-times", str(tmp_path / "times")))
    assert_same_training(run, optimizer="sgd", lr=0.1)
    launches = _bucket_launches(tmp_path / "times")
    assert len(launches) == 2 * run.steps
    for launched, last_compute_end in launches:
        assert len(launched) >= 2 and launched == sorted(launched)
        assert launched[0] < last_compute_end, "the first bucket waits for no more than its own layers"


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_and_data_parallel_train_like_one_process(tmp_path, schedule):
    run = compile_and_train(tmp_path, "gpt", pp=2, microbatches=4, schedule=schedule, dp=2, global_batch_size=16,
                            device=str(FREE_LINKS), train_args=("--action-times", str(tmp_path / "times")))
    assert run.plan.tied_parameters == {"wte.weight": (0, 1)}
    assert_same_training(run, optimizer="sgd", lr=0.1)
    assert all(len(launched) == 1 for launched, _ in _bucket_launches(tmp_path / "times"))  # 0.9 MB a stage


def test_buckets_are_marked_by_the_step_s_timer():
    """On a GPU the actions are marked by CUDA events in the stream; a bucket's launch, read off the
    host's clock instead, would fall before the backward whose gradients it carries had run."""
    from types import SimpleNamespace

    import torch

    from autopart.runtime.device import StepTimer
    from autopart.runtime.executor import Executor

    reducer = SimpleNamespace(clock=None)
    executor = Executor(rank=0, stages={}, last_stage=0, schedule={0: []}, microbatches=1, device=torch.device("cpu"),
                        reducer=reducer)
    timer = StepTimer(torch.device("cpu"))
    executor.step([()], timer=timer)
    assert reducer.clock == timer.mark


def _reduce_in_buckets(rank: int, port: int) -> None:
    """Two replicas reduce one stage's gradients: each ``.grad`` ends as a view of its bucket (no
    second copy of the gradients is held), holding the mean of the replicas' gradients."""
    import torch
    import torch.distributed as dist

    from autopart.runtime.reducer import GradientReducer
    from tests.distributed import gloo_group

    with gloo_group(rank, port, 2):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        actions = add_communication(build_schedule("1f1b", ranks=1, microbatches=1), ranks=1)[0]
        reducer = GradientReducer(modules={0: module}, orders={0: [n for n, _ in module.named_parameters()]},
                                  actions=actions, group=dist.group.WORLD, size=2)
        expected = {}
        for replica in range(2):
            module.zero_grad(set_to_none=True)
            module(torch.full((3, 4), float(replica + 1))).square().sum().backward()
            for name, parameter in module.named_parameters():
                expected[name] = expected.get(name, 0) + parameter.grad / 2
        module.zero_grad(set_to_none=True)
        for position, action in enumerate(actions):
            reducer.before(position, action)
            if action.kind is Kind.B:
                module(torch.full((3, 4), float(rank + 1))).square().sum().backward()
            reducer.after(position, action)
        reducer.wait()
        storages = {p.grad.untyped_storage().data_ptr() for p in module.parameters()}
        assert len(reducer.buckets) == 1 and len(storages) == 1, "every gradient a view of the one bucket"
        for name, parameter in module.named_parameters():
            torch.testing.assert_close(parameter.grad, expected[name], msg=name)


@pytest.mark.multiprocess
def test_gradients_live_in_their_buckets_once_launched():
    from tests.distributed import fork_ranks

    assert fork_ranks(_reduce_in_buckets, 2, timeout=60) == [0, 0]
