"""``autopart profile-comm``: real processes over gloo measure every curve, the wake curve among
them and the factor of compute inside a pipeline, and the ``cpu`` device answers with what they measured."""

import pytest

from cost_models.comm_profile import SIZES, WAKE_IDLES, load_comm_profile, profile_comm


@pytest.mark.multiprocess
def test_profile_comm_measures_every_curve_and_the_cpu_device_uses_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    profile, path = profile_comm(ranks=2)
    assert path.parent == tmp_path and load_comm_profile("cpu") == profile
    for kind in ("p2p", "all_reduce", "all_gather", "p2p_send_cpu", "p2p_recv_cpu"):
        points = profile.curves[kind]
        assert [size for size, _ in points] == list(SIZES), kind
        seconds = [s for _, s in points]
        assert all(s > 0 for s in seconds) and seconds == sorted(seconds), kind  # a larger message never takes less
    assert profile.curves["p2p_busy_delay"][0][1] >= 0
    # the wake curve: a point per idle time asked for, each at least that long, extra never shrinking with it
    wake = profile.curves["wake"]
    assert len(wake) == len(WAKE_IDLES)
    assert all(idle >= asked * 0.9 for (idle, _), asked in zip(wake, WAKE_IDLES))
    extras = [extra for _, extra in wake]
    assert all(e >= 0 for e in extras) and extras == sorted(extras)
    assert profile.process_bytes > 100 << 20  # torch and the runtime imported
    # compute inside a pipeline: one factor, the two ranks' mean, never below compute alone
    [[_, factor]] = profile.curves["pipeline_compute"]
    assert 1.0 <= factor < 2.0

    from cost_models import get_cost_model

    model = get_cost_model("cpu")
    assert model.wake_time(10.0) == pytest.approx(extras[-1])
    assert model.pipeline_compute_factor() == pytest.approx(factor)
    assert model.p2p_time(SIZES[2]) == pytest.approx(profile.curves["p2p"][2][1])
