"""Paths that autopart writes only when its work is done, checked before the work starts.

A training run writes its metrics after its first step, its weights after its last; a compile
writes its output directory after the search. A path it could never write (a folder where a file
goes, a file where a folder goes, a path under a file or under a link to nothing, a folder this
user may not write in) would fail there, after minutes or hours, with an OSError's traceback on
every rank; it fails here instead, as one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from autopart.ir.errors import ConfigError

__all__ = ["MARKER", "check_file_path", "check_folder_path", "check_parent", "as_umask", "save_tensors"]

MARKER = ".autopart-output.json"  # in an output directory: the files autopart compile wrote there


def check_parent(path: Path, flag: str, *, writes: bool = True, made_beside: bool = False) -> None:
    """Refuse ``path`` (given as ``flag``) where what lies above it, nearest first, is a file or a
    link to nothing; and where ``writes``, where this user may not write the path (when it
    exists) or the folder it would be made in. ``made_beside``: the path is made beside itself
    and renamed into place (a compile's output directory), so its folder is written even where
    the path exists."""
    path = Path(path).absolute()
    try:
        for place in (path, *path.parents):
            if place.is_symlink() and not place.exists():
                raise ConfigError(f"{flag} {path}: {place} is a link to nothing ({os.readlink(place)}); give a path "
                                  "that exists or can be made")
            if not place.exists():
                continue
            if place != path and not place.is_dir():
                raise ConfigError(f"{flag} {path} lies under {place}, which is a file; give a path under a folder")
            if writes and not os.access(place, os.W_OK | (os.X_OK if place.is_dir() else 0)):
                raise ConfigError(f"{flag} {path}: this user may not write in {place}; give a path you may write")
            if place == path and made_beside:
                continue
            return
    except OSError as exc:  # a folder above it that this user may not look into
        raise ConfigError(f"{flag} {path}: {exc.strerror or exc}; give a path you may write") from None


def check_file_path(path: Path | None, flag: str, *, writes: bool = True) -> None:
    """A file that will be written (made with the folders above it): refuse a folder, or a path
    that `check_parent` refuses."""
    if path is None:
        return
    if Path(path).is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give the path of a file")
    check_parent(path, flag, writes=writes)


def check_folder_path(path: Path | None, flag: str) -> None:
    """A folder that will be written into: refuse a file, or a path that `check_parent` refuses."""
    if path is None:
        return
    if Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{flag} {path} is a file; give the path of a folder")
    check_parent(path, flag)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file of ``tensors`` at ``path``, with the modes the user's umask gives (`as_umask`)."""
    save_file(tensors, str(path), metadata=metadata)
    return as_umask(path)


def as_umask(path: Path) -> Path:
    """``path`` given the modes the user's umask gives a file (or folder) they make: safetensors
    writes its files 0600 and ``tempfile.mkdtemp`` its folders 0700, which on a shared file system
    keeps the weights from the other users and jobs that would read them."""
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~_umask())
    return Path(path)


def _umask() -> int:
    """The process's umask, read where Linux shows it: setting it to read it (``os.umask``) would
    leave, for an instant, every file another thread makes open to all."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o077)  # the narrowest for the instant it is held
        os.umask(mask)
        return mask
