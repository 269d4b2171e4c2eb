"""The step model of the data-parallel all-reduce overlapped with the backward (`autopart.predict.reduction`),
on synthetic timelines: a bucket whose gradients are final early is hidden behind the compute,
one final at the end is paid in full, and on shared cores what it hides it takes from the compute."""

import math
import random
import runpy

import pytest

import autopart
from autopart.predict.reduction import (Reduction, StageGradients, collectives_delay, overlapped_step_time,
                                        rank_reductions, reduction_delay)
from autopart.solve.data_parallel_tail import exposed_all_reduce_s
from autopart.ir.buckets import plan_buckets
from autopart.schedule import Action, Kind, StageCosts, add_communication, build_schedule
from autopart.schedule.shared import step_time
from cost_models import get_cost_model
from tests.distributed import REPO

LAST_B = Action(stage=0, kind=Kind.B, microbatch=3)


def _reduction(seconds: float, share: float = 0.0, fraction: float = 1.0) -> Reduction:
    return Reduction(trigger=LAST_B, fraction=fraction, seconds=seconds, cpu_share=share)


def test_a_bucket_final_early_is_hidden_and_one_final_last_is_exposed():
    assert reduction_delay([0.2], [_reduction(0.3)], 1.0) == (0.0, 0.0)
    assert reduction_delay([1.0], [_reduction(0.3)], 1.0) == pytest.approx((0.0, 0.3))
    # one at a time: the second waits for the first, which ends past the compute
    assert reduction_delay([0.9, 0.95], [_reduction(0.2), _reduction(0.2)], 1.0) == pytest.approx((0.0, 0.3))
    # an early one runs past the end by what it has left
    assert reduction_delay([0.5], [_reduction(0.8)], 1.0) == pytest.approx((0.0, 0.3))


def test_on_shared_cores_a_hidden_reduction_takes_its_work_from_the_compute():
    # one core for the compute and the reduction (all work of the core): both run at half speed
    # until the reduction's 0.5 s of work are done at 1.0 s, then the compute's last 0.5 s alone
    delay, wait = reduction_delay([0.0], [_reduction(0.5, share=1.0)], 1.0, cores=1, busy=1)
    assert (delay, wait) == pytest.approx((0.5, 0.0))
    # a core to spare: nothing is taken
    assert reduction_delay([0.0], [_reduction(0.5, share=1.0)], 1.0, cores=2, busy=1) == pytest.approx((0.0, 0.0))
    # half its time on the core: beside the compute it is half a thread more, so both run at 2/3;
    # the compute's last 0.25 s take 0.375 s, in which the reduction (0.625 s at that rate) does
    # 60%; its last 40% run alone, at full speed: 0.2 s past the compute's end
    delay, wait = reduction_delay([0.75], [_reduction(0.5, share=0.5)], 1.0, cores=1, busy=1)
    assert (delay, wait) == pytest.approx((0.125, 0.2))


def test_the_step_pays_only_what_runs_past_each_ranks_last_action():
    schedule = add_communication(build_schedule("1f1b", ranks=2, microbatches=4, chunks=1), ranks=2)
    costs = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(1.0, 1.0), transfer_s=(0.0,))
    alone = step_time(schedule, costs, ranks=2)
    # each rank's last B is its last action: a reduction final there runs wholly past it; rank 1's
    # ends 2 s before rank 0's (stage 0's B of the last microbatch comes after it), so rank 1's
    # wait is hidden in the step, while rank 0's is paid
    reductions = {0: [Reduction(trigger=Action(stage=0, kind=Kind.B, microbatch=3), fraction=1.0, seconds=0.5)],
                  1: [Reduction(trigger=Action(stage=1, kind=Kind.B, microbatch=3), fraction=1.0, seconds=1.5)]}
    step, added = overlapped_step_time(schedule, costs, reductions, ranks=2)
    assert added == {0: pytest.approx((0.0, 0.5)), 1: pytest.approx((0.0, 1.5))}
    assert step == pytest.approx(alone + 0.5)
    # launched half-way through the last B, rank 0's reduction is hidden as well
    early = {0: [Reduction(trigger=Action(stage=0, kind=Kind.B, microbatch=3), fraction=0.5, seconds=0.5)]}
    step, added = overlapped_step_time(schedule, costs, early, ranks=2)
    assert step == pytest.approx(alone) and added == {0: pytest.approx((0.0, 0.0))}


@pytest.mark.parametrize("seed", range(12))
def test_with_a_device_per_rank_the_pipeline_runs_once_and_the_step_is_its_tails_after_it(monkeypatch, seed):
    # a rank's tail (its reductions' wait, the optimizer) follows its last action and changes no
    # one's pipeline: the step equals step_time's with the tails added, from one run
    import random

    from autopart.schedule import shared

    rng = random.Random(seed)
    ranks, microbatches = rng.randint(2, 4), rng.randint(2, 8)
    schedule = add_communication(build_schedule(rng.choice(["1f1b", "zb-h1", "gpipe"]), ranks=ranks,
                                                microbatches=microbatches), ranks=ranks)
    costs = StageCosts(forward_s=tuple(rng.uniform(0.5, 1.5) for _ in range(ranks)),
                       backward_s=tuple(rng.uniform(1.5, 3.0) for _ in range(ranks)), weight_s=(0.4,) * ranks,
                       transfer_s=(0.1,) * (ranks - 1), send_s=(0.02,) * (ranks - 1), recv_s=(0.03,) * (ranks - 1),
                       recv_waited_s=(0.01,) * (ranks - 1))
    last = {rank: [a for a in schedule[rank] if a.kind in (Kind.B, Kind.W)][-1] for rank in schedule}
    reductions = {rank: [Reduction(trigger=last[rank], fraction=rng.uniform(0.0, 1.0), seconds=rng.uniform(0.0, 3.0))]
                  for rank in schedule}
    tails = {rank: rng.choice([0.0, rng.uniform(0.0, 1.0)]) for rank in schedule}
    wake = (lambda idle: idle / 10) if seed % 2 else None
    runs, run_ahead = [], shared.run_ahead
    monkeypatch.setattr(shared, "run_ahead", lambda *args, **kwargs: runs.append(args) or run_ahead(*args, **kwargs))
    step, added = overlapped_step_time(schedule, costs, reductions, ranks=ranks, tail_s=tails, wake_s=wake)
    assert len(runs) == 1  # the pipeline ran once
    monkeypatch.undo()
    expected = step_time(schedule, costs, ranks=ranks, wake_s=wake,
                         tail_s={rank: tails[rank] + sum(added.get(rank, ())) for rank in schedule})
    assert step == expected


def test_buckets_are_final_as_the_backward_reaches_their_layers():
    actions = add_communication(build_schedule("1f1b", ranks=1, microbatches=2, chunks=1), ranks=1)[0]
    megabyte = 1 << 20
    stage = StageGradients(stage=0, parameters=(("embed", megabyte), ("h0", 2 * megabyte), ("head", megabyte)),
                           final_after={"embed": 1.0, "h0": 0.9, "head": 0.3})
    reductions = rank_reductions(actions, [stage], seconds=lambda nbytes: (nbytes / megabyte, 0.0))
    assert [(r.trigger, r.fraction, r.seconds) for r in reductions] == [
        (Action(stage=0, kind=Kind.B, microbatch=1), 0.3, 1.0),  # the first bucket: 1 MiB, the head's
        (Action(stage=0, kind=Kind.B, microbatch=1), 1.0, 3.0),
    ]
    split = add_communication(build_schedule("zb-h1", ranks=1, microbatches=2, chunks=1), ranks=1)[0]
    assert {r.fraction for r in rank_reductions(split, [stage], seconds=lambda n: (1.0, 0.0))} == {1.0}  # W: at its end


def test_a_compiled_plan_hides_the_first_bucket_and_pays_the_last():
    model = REPO / "tests" / "models" / "wide_gpt.py"
    plan = autopart.compile(model, pp=1, dp=2, microbatches=2, global_batch_size=8, device="a100-80gb")
    cost_model = get_cost_model("a100-80gb")
    sizes = {n: p.numel() * p.element_size() for n, p in runpy.run_path(str(model))["build_model"]().named_parameters()}
    first, last = plan_buckets([(0, [(n, sizes[n]) for n in plan.stages[0].parameters])])
    (delay, wait), = plan.predicted.reduction_s
    # the first MiB (the last layer's) went while the backward ran, which ran the slower for it
    # (NCCL's kernels hold SMs); the rest waited for its end
    slowdown = cost_model.device.overlap_compute_slowdown
    assert slowdown > 0
    first_s = cost_model.collective_time("all_reduce", first.nbytes, 2)
    assert delay == pytest.approx(first_s * slowdown / (1 + slowdown))
    assert wait == pytest.approx(cost_model.collective_time("all_reduce", last.nbytes, 2))
    assert wait < cost_model.collective_time("all_reduce", first.nbytes + last.nbytes, 2)


def test_one_rank_on_cores_with_a_reduction_that_takes_no_cpu_pays_it_after_the_compute():
    """One pipeline rank (dp alone), cores to share, a reduction that takes no CPU: nothing else
    is busy once the compute ends, and the reduction still takes its own time."""
    assert reduction_delay([1.0], [_reduction(0.3, share=0.0)], 1.0, cores=2.0, busy=1.0) == pytest.approx((0.0, 0.3))


def test_on_a_device_of_its_own_the_compute_beside_a_reduction_runs_slower_and_the_reduction_keeps_its_pace():
    """A GPU: NCCL's kernels hold SMs while a reduction runs, so the compute beside it goes at
    1 / (1 + slowdown) of its speed; the reduction itself takes its own time."""
    # 1 s beside a 2 s compute: 0.8 s of it done meanwhile, 1.2 s left alone
    assert reduction_delay([0.0], [_reduction(1.0)], 2.0, slowdown=0.25) == pytest.approx((0.2, 0.0))
    # 3 s beside it: the compute is slowed throughout (2.5 s) and the reduction runs 0.5 s past it
    assert reduction_delay([0.0], [_reduction(3.0)], 2.0, slowdown=0.25) == pytest.approx((0.5, 0.5))
    # ready as the compute ends: nothing beside it, nothing slowed
    assert reduction_delay([2.0], [_reduction(1.0)], 2.0, slowdown=0.25) == pytest.approx((0.0, 1.0))
    assert reduction_delay([0.0], [_reduction(1.0)], 2.0) == (0.0, 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_the_search_s_closed_form_of_an_exposed_all_reduce_is_the_step_model_s(seed):
    """``exposed_all_reduce_s`` (the search's) against ``collectives_delay`` (the plan's) for one
    rank: the early buckets ready as its last backward starts, the last bucket at its end."""
    rng = random.Random(seed)
    hidden, early, last = rng.uniform(0.1, 2), rng.uniform(0, 3), rng.uniform(0, 1)
    slowdown = rng.choice([0.0, 0.19, rng.uniform(0, 0.9)])
    delay, wait = collectives_delay([0.0, hidden], [(early, 0.0), (last, 0.0)], hidden, slowdown=slowdown)
    assert exposed_all_reduce_s(early + last, last, hidden, slowdown) == pytest.approx(delay + wait)
    # hidden without end (the layout bounds' most hidden): the least it adds, no NaN
    assert exposed_all_reduce_s(early + last, last, math.inf, slowdown) == pytest.approx(
        last + early * slowdown / (1 + slowdown))


@pytest.mark.parametrize("cores", [0, 2])
def test_a_misspelt_argument_is_refused_with_a_device_per_rank_as_with_shared_cores(cores):
    schedule = add_communication(build_schedule("1f1b", ranks=2, microbatches=2, chunks=1), ranks=2)
    costs = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(1.0, 1.0), transfer_s=(0.0,))
    reductions = {0: [Reduction(trigger=Action(stage=0, kind=Kind.B, microbatch=1), fraction=1.0, seconds=0.5)]}
    with pytest.raises(TypeError, match="wake"):
        overlapped_step_time(schedule, costs, reductions, ranks=2, cores=cores, wake=lambda idle: 0.0)


def test_a_tied_weights_all_reduce_is_priced_on_the_nodes_its_pipeline_ranks_sit_on() -> None:
    """examples/gpt.py ties its embedding to its head: the two pipeline ranks that hold it sum its
    gradient after the pipeline. On one node that is an NVLink all-reduce; with a node a rank, one
    across the network; the tail grows by the difference and by nothing else."""
    model = REPO / "examples" / "gpt.py"
    common = dict(pp=2, microbatches=2, device="h100-sxm", dtype="bf16")
    together = autopart.compile(model, gpus_per_node=8, **common).predicted.rank_tail_s
    apart = autopart.compile(model, gpus_per_node=1, **common).predicted.rank_tail_s
    namespace = runpy.run_path(str(model))
    config = namespace["CONFIG"]
    nbytes = 4 * config.vocab_size * config.n_embd  # the fp32 weight's gradient
    cost_model = get_cost_model("h100-sxm")
    extra = (cost_model.collective_time("all_reduce", nbytes, 2, nodes=2)
             - cost_model.collective_time("all_reduce", nbytes, 2, nodes=1))
    assert extra > 0
    assert [a - t for a, t in zip(apart, together)] == pytest.approx([extra, extra], rel=1e-9)
