"""What ranks tell each other at start-up (`check_nodes_agree`) and a measured trace's events go
as JSON in tensors (`autopart.runtime.exchange.gather_json`): a peer of a multi-node launch is
another machine, and nothing it sends is unpickled."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest

from tests.distributed import fork_ranks, gloo_group


def _refuse_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way torch's object collectives read a peer's bytes back, made to raise."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def unpickled(*args, **kwargs):
        raise AssertionError("a peer's bytes were unpickled")

    for module, name in ((pickle, "loads"), (pickle, "Unpickler"), (c10d, "_unpickler"), (dist, "all_gather_object"),
                         (dist, "gather_object"), (dist, "broadcast_object_list"), (c10d, "all_gather_object"),
                         (c10d, "gather_object")):
        monkeypatch.setattr(module, name, unpickled)


def _exchange(rank: int, port: int, out: Path) -> None:
    import torch

    from autopart.runtime.exchange import gather_json
    from autopart.runtime.executor import ActionRecord
    from autopart.runtime.launch import RefusedTogether, check_nodes_agree
    from autopart.runtime.measure import StepClock, write_measured_trace
    from autopart.schedule import Action

    with pytest.MonkeyPatch.context() as monkeypatch, gloo_group(rank, port, 2):
        _refuse_pickle(monkeypatch)
        mine = {"rank": rank, "text": "é" * (1 + 40 * rank), "pair": (0.9, 0.95)}  # lengths differ: padded
        expected = [{"rank": r, "text": "é" * (1 + 40 * r), "pair": [0.9, 0.95]} for r in range(2)]
        assert gather_json(mine) == expected
        assert gather_json(mine, dst=0) == (expected if rank == 0 else None)
        flags = dict(steps=2, lr=1e-3, betas=(0.9, 0.95), metrics=Path(f"m{rank}.jsonl"), timeout=10.0 + rank)
        check_nodes_agree(out, argparse.Namespace(**flags), None)  # paths as given or not, --timeout not at all
        with pytest.raises(RefusedTogether) as refused:
            check_nodes_agree(out, argparse.Namespace(**flags | {"steps": 2 + rank}), None)
        assert str(refused.value) == ("rank 1 was started with --steps 3 but rank 0 with --steps 2; give train.py "
                                      "the same options on every node")
        with pytest.raises(RefusedTogether) as refused:  # a tuple flag, as JSON brings it back (a list)
            check_nodes_agree(out, argparse.Namespace(**flags | {"betas": (0.9, [0.95, 0.96][rank])}), None)
        assert str(refused.value) == ("rank 1 was started with --betas 0.9,0.96 but rank 0 with --betas 0.9,0.95; "
                                      "give train.py the same options on every node")
        with pytest.raises(RefusedTogether) as refused:  # given on one node alone: not "--betas None"
            check_nodes_agree(out, argparse.Namespace(**flags | {"betas": [(0.9, 0.95), None][rank]}), None)
        assert str(refused.value) == ("rank 1 was started with no --betas but rank 0 with --betas 0.9,0.95; "
                                      "give train.py the same options on every node")
        clock = StepClock(torch.device("cpu"))
        clock.record.append(ActionRecord(Action.parse(f"{rank}F0"), clock.origin + rank, clock.origin + rank + 1, 0.5))
        timeline = write_measured_trace(clock, ranks=2, path=out / "trace.json", title="measured")
        assert (timeline is not None) == (rank == 0)
        if timeline is not None:  # rank 1's forward, sent to rank 0 as JSON
            assert sorted((str(e.action), e.rank, e.start, e.end) for e in timeline.events) == [
                ("0F0", 0, 0.0, 1.0), ("1F0", 1, 1.0, 2.0)]


@pytest.mark.multiprocess
def test_ranks_exchange_json_and_never_unpickle_what_a_peer_sent(tmp_path):
    (tmp_path / "plan.json").write_text("{}\n")
    assert fork_ranks(_exchange, 2, tmp_path, timeout=120) == [0, 0]
