"""Paths that autopart writes only when its work is done, checked before the work starts.

A training run writes its metrics after its first step, its weights after its last; a compile
writes its output directory after the search. A path it could never write (a folder where a file
goes, a file where a folder goes, a path under a file) would fail there, after minutes or hours,
with an OSError's traceback on one rank; it fails here instead, as one line.
"""

from __future__ import annotations

from pathlib import Path

from autopart.ir.errors import ConfigError

__all__ = ["check_file_path", "check_folder_path", "check_parent"]


def check_parent(path: Path, flag: str) -> None:
    """Refuse ``path`` (given as ``flag``) where what lies above it, nearest first, is a file."""
    above = next((folder for folder in Path(path).absolute().parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"{flag} {path} lies under {above}, which is a file; give a path under a folder")


def check_file_path(path: Path | None, flag: str) -> None:
    """A file that will be written (made with the folders above it): refuse a folder, or a path under a file."""
    if path is None:
        return
    if Path(path).is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give the path of a file")
    check_parent(path, flag)


def check_folder_path(path: Path | None, flag: str) -> None:
    """A folder that will be written into: refuse a file, or a path under a file."""
    if path is None:
        return
    if Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{flag} {path} is a file; give the path of a folder")
    check_parent(path, flag)
