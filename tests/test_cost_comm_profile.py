"""``autopart profile-comm``: real processes over gloo measure every curve, and each measured
figure is checked against something measured independently here (a memory copy, a sleep, the
process's own resident memory), and the ``cpu`` device answers with what they measured.

The profile makes its curves non-decreasing and clamps rank 0's pipeline factor at 1, so those
shapes say nothing about the measurement; the relations below can fail.
"""

import resource
import time

import pytest
import torch

from cost_models.comm_profile import QUICK, SIZES, WAKE_IDLES, load_comm_profile, profile_comm


def _copy_seconds(nbytes: int) -> float:
    """The best of a few copies of ``nbytes`` in this process, on one thread (as each rank runs;
    two threads on a shared machine wait for each other): a lower bound on moving them at all."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source, target = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        target.copy_(source)
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best


@pytest.mark.multiprocess
def test_profile_comm_measures_every_curve_and_the_cpu_device_uses_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    profile, path = profile_comm(ranks=2, effort=QUICK)  # every curve FULL measures, on fewer samples
    assert path.parent == tmp_path and load_comm_profile("cpu") == profile
    for kind in ("p2p", "all_reduce", "all_gather", "p2p_send_cpu", "p2p_recv_cpu"):
        assert [size for size, _ in profile.curves[kind]] == list(SIZES), kind
    p2p = dict(profile.curves["p2p"])
    largest = SIZES[-1]
    # gloo on loopback copies a message through the kernel at least once: never faster than a copy
    assert p2p[largest] >= _copy_seconds(largest)
    # 2 ranks: each receives at least half the buffer through the kernel (and adds it): never faster
    # than a copy of half of it. (Not against half a p2p message: the two curves are measured seconds
    # apart, and the other processes here can slow one of them by more than twice the other.)
    assert dict(profile.curves["all_reduce"])[largest] >= _copy_seconds(largest // 2)
    # each side's CPU seconds count the kernel's copy of the message into or out of its socket (in the
    # calling thread or gloo's): never under half a copy. No upper bound holds: these are cold messages
    # between computations, p2p's are hot ones back to back, and how far apart they are depends on
    # who else runs here
    for kind in ("p2p_send_cpu", "p2p_recv_cpu"):
        assert dict(profile.curves[kind])[largest] >= 0.5 * _copy_seconds(largest), kind
    wake = profile.curves["wake"]  # a point per idle time asked for (the idle is a median of rank 1's, not a bound)
    assert len(wake) == len(WAKE_IDLES)
    # a rank's resident memory: at least torch's libraries, at most many times this test process's peak
    # (which grows with every test the process ran before, so it bounds nothing from below)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert 100 << 20 < profile.process_bytes < 4 * own
    [[_, factor]] = profile.curves["pipeline_compute"]
    assert factor > 0  # how much slower depends on who else runs here: no bound holds on a shared machine

    from cost_models import get_cost_model

    model = get_cost_model("cpu")
    assert model.wake_time(10.0) == pytest.approx(wake[-1][1])
    assert model.pipeline_compute_factor() == pytest.approx(factor)
    assert model.p2p_time(SIZES[2]) == pytest.approx(profile.curves["p2p"][2][1])
    between = (SIZES[2] + SIZES[3]) / 2  # interpolated between the measured sizes
    assert profile.curves["p2p"][2][1] <= model.p2p_time(between) <= profile.curves["p2p"][3][1]


def test_a_measured_rank_size_is_the_cpu_s_overhead_and_never_a_gpu_s(tmp_path, monkeypatch) -> None:
    """profile-comm measures a rank's resident (host) memory: the CPU's overhead, while a GPU's is
    device memory (its context, NCCL, workspaces), which that does not measure."""
    import json
    from dataclasses import asdict

    from cost_models.comm_profile import CommProfile, cache_path
    from cost_models.devices import FRAMEWORK_OVERHEAD_BYTES, load_device

    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    for device, backend in (("cpu", "gloo"), ("h100-sxm", "nccl")):
        profile = CommProfile(device=device, backend=backend, ranks=2, host="test", torch_version=torch.__version__,
                              curves={"p2p": [[4, 1e-5], [1 << 20, 1e-4]]}, process_bytes=3 << 30)
        cache_path(device, backend).parent.mkdir(parents=True, exist_ok=True)
        cache_path(device, backend).write_text(json.dumps(asdict(profile)))
    assert load_device("cpu").framework_overhead_bytes == 3 << 30
    gpu = load_device("h100-sxm")
    assert gpu.comm_curves and gpu.framework_overhead_bytes == FRAMEWORK_OVERHEAD_BYTES["cuda"]


@pytest.mark.parametrize("curves", [{"p2p": "x"}, {"p2p": [[4]]}, {"p2p": [[4, float("nan")]]}, {"p2p": [[4, -1e-5]]},
                                    {"p2p": [[4, float("inf")]]}, ["p2p"]])
def test_a_cached_message_profile_edited_out_of_shape_is_measured_again(tmp_path, monkeypatch, curves) -> None:
    """A cached profile whose curves are not [bytes, seconds] pairs of finite figures failed the
    compile with a traceback (the device spec unpacking them), or put NaN into every message."""
    import json
    from dataclasses import asdict

    from cost_models.comm_profile import CommProfile, cache_path
    from cost_models.devices import load_device

    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    profile = CommProfile(device="cpu", backend="gloo", ranks=2, host="test", torch_version=torch.__version__,
                          curves={"p2p": [[4, 1e-5], [1 << 20, 1e-4]]}, process_bytes=3 << 30)
    cache_path("cpu", "gloo").write_text(json.dumps(asdict(profile)))
    assert load_comm_profile("cpu") == profile
    cache_path("cpu", "gloo").write_text(json.dumps({**asdict(profile), "curves": curves}))
    assert load_comm_profile("cpu") is None
    assert load_device("cpu").comm_curves == {}  # the link formula until 'autopart profile-comm' measures again
