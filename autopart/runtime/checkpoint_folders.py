"""A checkpoint directory's folders: which steps are saved and whole, how a save is put in place
and an earlier save of the same step removed, and when a run may not start in a folder.

``DIR/step_<n>`` is a save that rank 0 renamed into place once every rank had written it into
``DIR/.step_<n>.partial``; its ``autopart.json`` (`RECORD`) lists every file with its sha256, so a
damaged save is passed over for the one before. Nothing is removed that the record of a folder
autopart saved does not list, and nothing outside that folder, whatever its record names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from autopart.ir.errors import CheckpointError, ConfigError
from autopart.runtime.launch import file_sha256, plan_digest
from autopart.runtime.process_exit import say

__all__ = ["RECORD", "SHARES_WITHIN_S", "candidates", "check_folder", "damaged", "latest_checkpoint", "newest_intact",
           "not_saved", "problem", "put_in_place", "read_record", "remove_saved", "share", "staging_folder",
           "step_folder", "step_of", "write_digests", "write_record"]

RECORD = "autopart.json"
_STEP = "step_"
_DIGESTS = ".sha256-of-rank-"  # a rank's share of a save's digests, while it is staged
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # torch.distributed.checkpoint's FileSystemWriter's, per rank
SHARES_WITHIN_S = 60.0  # how long rank 0 waits to see every rank's share (NFS caches a directory up to 60 s)


def step_folder(root: Path, step: int) -> Path:
    """Where the save after ``step`` steps lies once it is complete."""
    return root / f"{_STEP}{step:08d}"


def staging_folder(root: Path, step: int) -> Path:
    """Where the ranks write it first: a hidden name that no resume reads."""
    return root / f".{_STEP}{step:08d}.partial"


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files of a checkpoint that ``rank`` reads for their sha256, so that the ranks of a
    large job hash a save (and check one on resume) together, where one rank alone would read it
    all: the files DCP wrote for it (``__<rank>_<n>.distcp``; each rank sees its own on any
    filesystem at once), and rank 0's the rest (DCP's ``.metadata``, the compile's files)."""
    return sorted(name for name in names if _writer(name, world_size) == rank)


def _writer(name: str, world_size: int) -> int:
    """The rank whose share ``name`` is: its DCP writer's, else 0."""
    match = _DCP_FILE.match(name)
    return int(match.group(1)) if match and int(match.group(1)) < world_size else 0


def write_digests(staging: Path, rank: int, world_size: int) -> None:
    """This rank's share of the sha256 of the files written into ``staging`` so far, in a small
    JSON file there that `write_record` folds into the record."""
    names = [p.name for p in staging.iterdir() if p.is_file() and not p.name.startswith(_DIGESTS)]
    digests = {name: file_sha256(staging / name) for name in share(names, rank, world_size)}
    (staging / f"{_DIGESTS}{rank}").write_text(json.dumps(digests))


def write_record(staging: Path, *, step: int, out_dir: Path, optimizer: str, flags: dict[str, str],
                 world_size: int = 1) -> None:
    """The compile's files beside the tensors, and the record of them all, written to disk. Every
    one of the ``world_size`` ranks' shares of the digests must come (a network filesystem may
    show another host's new file a little late): one that does not wrote into a folder this node
    does not see (a --checkpoint-dir on each node's own disk)."""
    parts = [staging / f"{_DIGESTS}{rank}" for rank in range(world_size)]  # `write_digests`
    deadline = time.monotonic() + SHARES_WITHIN_S
    while (missing := sum(not part.is_file() for part in parts)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if missing:
        raise CheckpointError(f"{staging} holds the files of {world_size - missing} of the {world_size} ranks: the "
                              "others wrote into a folder of the same name that this node does not see; give "
                              "--checkpoint-dir on a filesystem that every node shares")
    shutil.copyfile(out_dir / "plan.json", staging / "plan.json")
    shutil.copyfile(out_dir / "model.py", staging / "model.py")
    hashed: dict[str, str] = {}
    for part in parts:
        hashed.update(json.loads(part.read_text()))
        part.unlink()
    seen = {p.name for p in staging.iterdir() if p.is_file()}  # a listing may lag behind, as above
    files = {name: hashed.get(name) or file_sha256(staging / name) for name in sorted(seen | set(hashed))}
    record = {"step": step, "optimizer": optimizer, "plan_sha256": plan_digest(out_dir / "plan.json"), "flags": flags,
              "files": files}
    with open(staging / RECORD, "w") as file:
        json.dump(record, file, indent=2)
        file.flush()
        os.fsync(file.fileno())


def put_in_place(staging: Path, final: Path) -> None:
    """Rename a complete save to its step's name. A step saved again (after a resume) replaces
    the earlier save, which is checked to hold only what autopart wrote before anything moves,
    then moved aside, and removed only once the new one is in place: a crash leaves one of the
    two whole (the aside one, ``.step_<n>.replaced``, is not read back but is not lost)."""
    if not final.exists():
        staging.rename(final)
        return
    aside = final.with_name(f".{final.name}.replaced")
    remove_saved(aside)  # a crash's leftover, between these renames
    _saved_files(final)
    final.rename(aside)
    staging.rename(final)
    try:  # the new save is in place: what is left of the old one is only noted
        remove_saved(aside)
    except (OSError, CheckpointError) as exc:
        say(f"autopart: note: the earlier save of {final.name} stays in {aside} ({exc})")


def _saved_files(path: Path) -> list[Path]:
    """The files of a checkpoint folder that autopart saved: its record's files and the record.
    Anything else in it is a file autopart did not write, and refused."""
    try:
        listed = {str(name) for name in read_record(path)["files"]} | {RECORD}
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} exists but holds no readable {RECORD}, so autopart did not save it; "
                              "move it away or choose another --checkpoint-dir") from None
    entries = sorted(path.iterdir())
    other = [p.name for p in entries if p.name not in listed or p.is_symlink() or not p.is_file()]
    if other:
        raise CheckpointError(f"{path} holds {other[0]}, which autopart did not save there; "
                              "move it away or choose another --checkpoint-dir")
    return entries


def remove_saved(path: Path) -> None:
    """Remove a checkpoint that autopart saved: its files (`_saved_files`, refused as a whole
    before anything is removed when the folder holds anything else), then the folder. Only the
    files found in the folder are removed, whatever names the record lists."""
    if not path.exists():
        return
    for entry in sorted(_saved_files(path), key=lambda entry: entry.name == RECORD):  # the record last: a folder
        entry.unlink()  # left part-way by a crash still says what autopart may remove from it
    path.rmdir()


def check_folder(root: Path, *, resuming: bool) -> None:
    """Refuse a --checkpoint-dir that is one checkpoint (``autopart.json`` in it), whose saves
    would go inside it while every resume took it again; one that holds a ``step_<n>`` of the
    user's, no save of autopart's (see `not_saved`); and, for a run from step 0, one that holds
    an earlier run's checkpoints: its saves would interleave with theirs, and a later resume (or a
    torchrun restart) would take the newest step of either run."""
    if (root / RECORD).exists():
        raise ConfigError(f"--checkpoint-dir {root} is one checkpoint, not a folder of them: give the folder it is in "
                          f"({root.parent}) with --resume, which takes its newest whole checkpoint, or copy this one "
                          "into a new folder and give that")
    stranger = next((path for path in candidates(root) if not_saved(path)), None) if root.is_dir() else None
    if stranger is not None:  # not a damaged save, which a resume passes over: 'restore it from a copy' misleads
        raise ConfigError(f"--checkpoint-dir {root} holds {stranger.name}, which autopart did not save (it holds no "
                          f"{RECORD} and none of a checkpoint's files); move it out of {root}, or give another "
                          "--checkpoint-dir")
    saved = candidates(root) if root.is_dir() and not resuming else []  # newest first
    if saved:
        raise ConfigError(f"--checkpoint-dir {root} already holds checkpoints of an earlier run (the latest "
                          f"{saved[0].name}); add --resume to go on from them, or give a new or empty --checkpoint-dir")


def not_saved(path: Path) -> bool:
    """Whether ``path``, named as a save is, is no save at all, even a damaged one: not a folder,
    or one that holds none of the files a save holds (its record, DCP's)."""
    if not path.is_dir():
        return True
    try:
        names = [entry.name for entry in path.iterdir()]
    except OSError:  # unreadable: the resume's check of the save says why
        return False
    return not any(name in (RECORD, ".metadata") or _DCP_FILE.match(name) for name in names)


def problem(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Why a checkpoint directory cannot be used, or None when every file is as it was written:
    its record, every file it lists, and of those the ``rank``-th `share`'s sha256."""
    try:
        files = dict(read_record(path)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{RECORD} is missing or unreadable"
    for name in files:
        if not (path / name).is_file():
            return f"{name} is missing"
    for name in share(list(files), rank, world_size):
        try:
            if file_sha256(path / name) != files[name]:
                return f"{name} does not match its sha256"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
    return None


def candidates(root: Path) -> list[Path]:
    """What a resume from ``root`` may take, best first: ``root`` itself when it is a checkpoint,
    else its checkpoint folders, newest first."""
    if (root / RECORD).exists():
        return [root]
    return sorted((p for p in root.glob(f"{_STEP}*") if step_of(p) >= 0), key=step_of, reverse=True)


def damaged(path: Path, why: str) -> str:
    """The line of a checkpoint passed over for an earlier one."""
    return f"checkpoint {path} is damaged ({why}); falling back to an earlier one"


def step_of(path: Path) -> int:
    """The steps a checkpoint folder holds, n of its name ``step_<n>`` as `step_folder` writes it;
    -1 for any other name."""
    number = path.name.removeprefix(_STEP)
    if path.name == number or not number.isdigit() or path.name != step_folder(path.parent, int(number)).name:
        return -1
    return int(number)


def newest_intact(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete, intact checkpoint under ``root`` (or ``root`` itself when it is one),
    and every newer one passed over with why, newest first: each checked, its files hashed, once."""
    root = Path(root)
    passed = []
    for path in candidates(root):
        why = problem(path)
        if why is None:
            return path, passed
        if path == root:  # a checkpoint itself: nothing earlier to fall back to
            raise ConfigError(f"checkpoint {root} is damaged: {why}; use an earlier step_* directory")
        passed.append((path, why))
    return None, passed


def latest_checkpoint(root: Path) -> tuple[Path | None, list[str]]:
    """`newest_intact`, with one line (`damaged`) for every newer checkpoint that was passed over."""
    path, passed = newest_intact(root)
    return path, [damaged(folder, why) for folder, why in passed]


def read_record(path: Path) -> dict:
    return json.loads((Path(path) / RECORD).read_text())
