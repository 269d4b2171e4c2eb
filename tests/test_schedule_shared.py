"""Step time when ranks share cores: processor sharing over the same action lists."""

import pytest

from autopart.schedule import StageCosts, add_communication, build_schedule, simulate
from autopart.schedule.shared import step_time
from cost_models import load_device


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_processor_sharing_bounds(kind: str, ranks: int) -> None:
    schedule = add_communication(build_schedule(kind, ranks=ranks, microbatches=8, chunks=1), ranks=ranks)
    costs = StageCosts(forward_s=(1.0,) * ranks, backward_s=(2.0,) * ranks, weight_s=(0.5,) * ranks,
                       transfer_s=(0.1,) * (ranks - 1))
    alone = simulate(schedule, costs, ranks=ranks).step_s
    # a core per rank: the simulator's step, then the tail of the last rank to finish
    assert step_time(schedule, costs, ranks=ranks) == pytest.approx(alone)
    assert step_time(schedule, costs, ranks=ranks, tail_s={ranks - 1: 0.0, 0: 0.25}) == pytest.approx(alone + 0.25)
    # one core: every second of work runs one after another
    work = 8 * 3.0 * ranks
    assert work - 1e-9 <= step_time(schedule, costs, ranks=ranks, cores=1) <= work + 1.0
    shared = step_time(schedule, costs, ranks=ranks, cores=2)
    if ranks <= 2:
        assert shared == pytest.approx(alone)
    else:
        assert max(alone, work / 2) <= shared + 1e-9 and shared < work


def test_measured_comm_curves_interpolate_and_extend(tmp_path) -> None:
    spec = load_device("h100-sxm")
    import dataclasses

    measured = dataclasses.replace(spec, comm_curves={"p2p": [[4, 1e-4], [1000, 2e-4], [2000, 4e-4]]}, comm_ranks=2)
    assert measured.measured_comm_time("p2p", 1) == 1e-4
    assert measured.measured_comm_time("p2p", 1500) == pytest.approx(3e-4)
    assert measured.measured_comm_time("p2p", 3000) == pytest.approx(6e-4)
    assert measured.measured_comm_time("all_reduce", 10) is None
