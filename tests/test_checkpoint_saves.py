"""How a save lands on disk: a step saved again replaces the earlier save only once the new one is
complete and only when the earlier one holds nothing but autopart's files; a failure of rank 0,
which alone puts a save in place, ends every rank with one line; a record read back removes
nothing outside its own folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from autopart.ir.errors import CheckpointError
from autopart.runtime.checkpoint import CheckpointContext, save_checkpoint
from autopart.runtime.checkpoint_folders import RECORD, latest_checkpoint, read_record, remove_saved
from tests.distributed import fork_ranks, gloo_group


def _stand_in_compile(folder: Path) -> None:
    """The compile's files a save copies, as ``folder/out`` (the saves here write ``folder/ckpt``)."""
    out = folder / "out"
    out.mkdir()
    (out / "plan.json").write_text(json.dumps({"plan": "a stand-in"}))
    (out / "model.py").write_text("")


def _save(folder: Path, rank: int, value: float) -> Path:
    state = {f"model/stage_{rank}/tp_0/w": torch.full((4,), value), "progress/step": torch.tensor(1)}
    return save_checkpoint(folder / "ckpt", state, step=1, rank=rank, out_dir=folder / "out", optimizer="sgd",
                           device=torch.device("cpu"))


def _save_again(rank: int, port: int, folder: Path) -> None:
    """Two ranks save step 1 three times: fresh, again (replacing it), and again over a folder
    that holds a file of the user's, which rank 0 refuses to remove."""
    with gloo_group(rank, port, 2):
        first = _save(folder, rank, 1.0)
        digests = read_record(first)["files"]
        assert _save(folder, rank, 2.0) == first
        second = read_record(first)["files"]
        assert second != digests, "the new save's files, not the old ones"
        assert sorted(p.name for p in (folder / "ckpt").iterdir()) == ["step_00000001"], "nothing left aside"
        torch.distributed.barrier()
        if rank == 0:
            (first / "notes.txt").write_text("mine")
        torch.distributed.barrier()
        with pytest.raises(CheckpointError) as error:
            _save(folder, rank, 3.0)
        if rank == 0:
            assert "step_00000001 holds notes.txt, which autopart did not save there" in str(error.value)
        else:
            assert "another rank failed (its error says why)" in str(error.value)
        assert (first / "notes.txt").read_text() == "mine"
        assert read_record(first)["files"] == second, "the second save, left as it was"


def test_a_step_saved_again_replaces_the_save_and_a_failure_of_rank_0_ends_every_rank(tmp_path: Path) -> None:
    _stand_in_compile(tmp_path)
    assert fork_ranks(_save_again, 2, tmp_path, timeout=60) == [0, 0]
    path, skipped = latest_checkpoint(tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / "step_00000001" and skipped == [], "the second save is intact"


def test_a_record_that_names_files_outside_its_folder_removes_none_of_them(tmp_path: Path) -> None:
    victim = tmp_path / "thesis.txt"
    victim.write_text("mine")
    step = tmp_path / "ckpt" / "step_00000001"
    step.mkdir(parents=True)
    (step / "data.distcp").write_bytes(b"saved")
    files = {"data.distcp": hashlib.sha256(b"saved").hexdigest(), "../../thesis.txt": "0", str(victim): "0"}
    (step / RECORD).write_text(json.dumps({"step": 1, "files": files}))
    remove_saved(step)
    assert not step.exists() and victim.read_text() == "mine"


def _context(rank: int, root: Path) -> CheckpointContext:
    """A rank's checkpoints under ``root``, of a one-layer model trained with SGD."""
    module = torch.nn.Linear(2, 2)
    return CheckpointContext(root=root, out_dir=root, modules={0: module}, rank=rank, dp_rank=0, tp_rank=0,
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.1), optimizer_name="sgd", zero=0,
                             seed=0, device=torch.device("cpu"), flags={})  # fmt: skip


def _choose(rank: int, port: int, root: Path) -> None:
    """Two ranks choose the checkpoint to resume from ``root``, each reading half the files for
    their sha256: ``__1_0.distcp``, which DCP writes for rank 1, is its share."""
    context = _context(rank, root)

    def saved(folder: Path, wrong: bool) -> Path:
        folder.mkdir(parents=True)
        for name in ("__0_0.distcp", "__1_0.distcp"):
            (folder / name).write_bytes(name.encode())
        digest = hashlib.sha256(b"__1_0.distcp").hexdigest()
        files = {"__0_0.distcp": hashlib.sha256(b"__0_0.distcp").hexdigest(),
                 "__1_0.distcp": "0" * 64 if wrong else digest}
        (folder / RECORD).write_text(json.dumps({"step": 1, "files": files}))
        return folder

    with gloo_group(rank, port, 2):
        if rank == 0:
            root.mkdir()
        torch.distributed.barrier()
        assert context.chosen() is None and context.resume() == 0, "nothing there yet"
        torch.distributed.barrier()
        if rank == 0:
            saved(root / "step_00000001", wrong=False)
            saved(root / "step_00000002", wrong=True)
        torch.distributed.barrier()
        assert context.chosen() == root / "step_00000001", "rank 1 found step 2 damaged: both fall back"


def _resume_where_every_checkpoint_is_damaged(rank: int, port: int, root: Path) -> None:
    context = _context(rank, root)
    with gloo_group(rank, port, 2):
        if rank == 0:
            for step in (1, 2):
                folder = root / f"step_{step:08d}"
                folder.mkdir(parents=True)
                (folder / "__0_0.distcp").write_bytes(b"damaged")
                (folder / RECORD).write_text(json.dumps({"step": step, "files": {"__0_0.distcp": "0" * 64}}))
        torch.distributed.barrier()
        with pytest.raises(CheckpointError, match=r"every checkpoint in .*ckpt is damaged \(2 checked; the lines above "
                                                  r"say how\), and --resume would start again from step 0; restore the "
                                                  r"folder from a copy, or drop --resume"):
            context.resume()


def test_a_resume_where_every_checkpoint_is_damaged_is_refused_not_begun_again(tmp_path: Path) -> None:
    """Every rank refuses together; before, they trained from step 0 with exit code 0, having said
    'no checkpoint yet' of a folder of them."""
    assert fork_ranks(_resume_where_every_checkpoint_is_damaged, 2, tmp_path / "ckpt", timeout=60) == [0, 0]


def _resume_past_many_damaged(rank: int, port: int, root: Path) -> None:
    context = _context(rank, root)
    with gloo_group(rank, port, 2):
        if rank == 0:
            for step in range(1, 1027):  # one intact, under 1,025 newer ones that lack their file
                folder = root / f"step_{step:08d}"
                folder.mkdir(parents=True)
                if step == 1:
                    (folder / "__0_0.distcp").write_bytes(b"saved")
                (folder / RECORD).write_text(json.dumps({"step": step, "files": {
                    "__0_0.distcp": hashlib.sha256(b"saved").hexdigest()}}))
        torch.distributed.barrier()
        assert context.chosen() == root / "step_00000001"


def test_a_resume_looks_past_any_number_of_damaged_checkpoints(tmp_path: Path) -> None:
    """The ranks looked at the newest 1,024 only, and said that every checkpoint was damaged (and
    refused to resume) where an older one was intact."""
    assert fork_ranks(_resume_past_many_damaged, 2, tmp_path / "ckpt", timeout=120) == [0, 0]


def test_the_ranks_check_a_checkpoint_together_and_agree_on_the_one_to_resume(tmp_path: Path, capfd) -> None:
    """Each rank reads its share of the files for their sha256 (one rank alone would read them
    all); the one that finds a damaged file says so, and every rank passes that checkpoint over."""
    assert fork_ranks(_choose, 2, tmp_path / "ckpt", timeout=60) == [0, 0]
    said = "step_00000002 is damaged (__1_0.distcp does not match its sha256); falling back to an earlier one (rank 1)"
    assert said in capfd.readouterr().err


def test_a_save_is_hashed_by_its_ranks_together(tmp_path: Path) -> None:
    """`share` deals the files out so that the ranks' shares cover them once: each rank the files
    DCP wrote for it, which it sees at once whatever the filesystem."""
    from autopart.runtime.checkpoint_folders import share

    names = [f"__{r}_{k}.distcp" for r in range(4) for k in range(3)] + [".metadata", "plan.json", "model.py"]
    shares = [share(names, rank, 4) for rank in range(4)]
    assert sorted(sum(shares, [])) == sorted(names), "every file in one share"
    assert shares[2] == ["__2_0.distcp", "__2_1.distcp", "__2_2.distcp"], "each rank the files it wrote"
    assert set(shares[0]) == {"__0_0.distcp", "__0_1.distcp", "__0_2.distcp", ".metadata", "plan.json", "model.py"}


def _save_apart(rank: int, port: int, folder: Path) -> None:
    """Rank 1's files land where rank 0 does not see them (each node's own disk): its share of
    the digests never reaches rank 0's folder."""
    from autopart.runtime import checkpoint, checkpoint_folders

    if rank == 1:
        checkpoint.write_digests = lambda staging, rank, world_size: None
    checkpoint_folders.SHARES_WITHIN_S = 2.0  # rank 0 waits this long for rank 1's share (60 s in a run)
    with gloo_group(rank, port, 2):
        with pytest.raises(CheckpointError) as error:
            _save(folder, rank, 1.0)
        if rank == 0:
            assert "holds the files of 1 of the 2 ranks" in str(error.value)
            assert "give --checkpoint-dir on a filesystem that every node shares" in str(error.value)
        else:
            assert "another rank failed (its error says why)" in str(error.value)
        assert not (folder / "ckpt" / "step_00000001").exists()


def test_a_checkpoint_dir_that_not_every_node_sees_is_refused(tmp_path: Path) -> None:
    _stand_in_compile(tmp_path)
    assert fork_ranks(_save_apart, 2, tmp_path, timeout=60) == [0, 0]


def _fail_hashing(rank: int, port: int, folder: Path) -> None:
    """Rank 1 cannot read its files back: both ranks stop at once, each saying why."""
    from autopart.runtime import checkpoint

    def unreadable(staging, rank, world_size):
        raise PermissionError(13, "Permission denied")

    if rank == 1:
        checkpoint.write_digests = unreadable
    with gloo_group(rank, port, 2):
        with pytest.raises(CheckpointError) as error:
            _save(folder, rank, 1.0)
        expected = "rank 1 cannot hash its files" if rank == 1 else "another rank failed (its error says why)"
        assert expected in str(error.value)


def test_any_rank_s_failure_during_a_save_ends_every_rank(tmp_path: Path) -> None:
    _stand_in_compile(tmp_path)
    assert fork_ranks(_fail_hashing, 2, tmp_path, timeout=60) == [0, 0]
