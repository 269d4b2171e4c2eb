"""Which output directory a compile may replace, and how it replaces one without losing a user's file.

``-o OUT`` is often a path that already exists. A compile replaces it only when autopart wrote
everything in it: every compile leaves ``OUT/.autopart-output.json`` listing the files it wrote
(and the plan's hash), and a directory holding any other file, a symbolic link, or no such list
is refused before any work is done. Replacing removes the listed files one by one and then
the emptied folders; nothing is removed by walking a tree, so a file that appears in between
stops the replacement instead of being deleted with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from autopart.ir.errors import ConfigError, ModelFileError
from autopart.ir.model_file import ModelSpec, files_beside
from autopart.runtime.output_paths import MARKER, check_parent
from autopart.runtime.launch import plan_digest

__all__ = ["MARKER", "OWN_NAMES", "check_files_beside", "check_output_directory", "write_marker", "remove_output"]

OWN_NAMES = frozenset({"model.py", "train.py", "plan.json", "report.md", "schedule.csv", "timeline.png", "trace.json",
                       "stages", "weights"})
"""What the output directory holds at its top of its own, besides its marker."""


def check_files_beside(spec: ModelSpec) -> None:
    """Refuse a model file that imports a module from beside it under a name the output directory
    keeps for its own files: the output directory carries those modules beside its copy of the
    model file (`autopart.ir.model_file.files_beside`). Known once the model file is loaded: the
    compile says so right after the capture (`autopart.passes.early_refusals`), not when it emits,
    its last step."""
    for relative in files_beside(spec):
        if relative.partition("/")[0] in OWN_NAMES:
            raise ModelFileError(f"{spec.path.name} imports {relative} from beside it, a name the output directory "
                                 "keeps for its own files; rename that module")


def _listed(out_dir: Path) -> set[str]:
    """The files the marker lists (relative POSIX paths); refuses where there is no readable marker."""
    if not (out_dir / MARKER).exists():
        raise ConfigError(
            f"output directory '{out_dir}' holds files but no {MARKER}, so autopart did not write it; "
            "choose a new or empty directory for -o"
        )
    try:
        data = json.loads((out_dir / MARKER).read_text())
        files = data["files"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise TypeError("'files' is no list of paths")
    except (OSError, ValueError, KeyError, TypeError) as exc:  # the list of what is autopart's is lost
        why = exc.strerror if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        raise ConfigError(
            f"output directory '{out_dir}' holds a {MARKER} that cannot be read ({why}), so which of its files "
            "autopart wrote is unknown; choose a new or empty directory for -o, or remove this one yourself"
        ) from None
    return {f for f in files if not f.startswith("/") and ".." not in Path(f).parts}


def _is_bytecode_of(relative: Path, listed: set[str]) -> bool:
    """``D/__pycache__/X.<tag>.pyc`` that Python wrote when it imported a listed ``D/X.py``."""
    if relative.parent.name != "__pycache__" or relative.suffix != ".pyc":
        return False
    source = relative.parent.parent / f"{relative.name.split('.')[0]}.py"
    return source.as_posix() in listed


def _owned_files(out_dir: Path) -> list[Path]:
    """Every file under ``out_dir`` (relative paths) once each is known to be autopart's; refuses otherwise."""
    listed = _listed(out_dir)
    owned = []
    for folder, folders, files in os.walk(out_dir, followlinks=False):
        for name in [*folders, *files]:
            path = Path(folder) / name
            relative = path.relative_to(out_dir)
            if path.is_symlink():
                raise ConfigError(
                    f"output directory '{out_dir}' holds the symbolic link {relative.as_posix()}, which autopart "
                    "never writes; choose a new or empty directory for -o"
                )
            if name in files and relative.as_posix() != MARKER:
                if relative.as_posix() not in listed and not _is_bytecode_of(relative, listed):
                    raise ConfigError(
                        f"output directory '{out_dir}' holds other files (first {relative.as_posix()}), which "
                        "autopart did not write; choose a new or empty directory for -o"
                    )
                owned.append(relative)
    return owned


def check_output_directory(out_dir: Path) -> None:
    """Refuse, before any work, to write over anything in ``out_dir`` that autopart did not write."""
    if out_dir.is_symlink():
        raise ConfigError(f"output path '{out_dir}' is a symbolic link; give the directory itself with -o")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"output path '{out_dir}' is a file; choose a directory path for -o")
    check_parent(out_dir, "-o", made_beside=True)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        _owned_files(out_dir)


def write_marker(out_dir: Path) -> None:
    """List every file under ``out_dir`` as autopart's, with the hash of the plan they belong to."""
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    marker = {"plan_sha256": plan_digest(out_dir / "plan.json"), "files": files}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def remove_output(out_dir: Path) -> None:
    """Remove an output directory that autopart wrote: its listed files, then its emptied folders.

    A folder that is not empty by then holds something that appeared since the check: the
    removal stops there with an error and that something is kept.
    """
    if not out_dir.exists():
        return
    check_output_directory(out_dir)
    for relative in _owned_files(out_dir) if any(out_dir.iterdir()) else []:
        (out_dir / relative).unlink()
    (out_dir / MARKER).unlink(missing_ok=True)
    folders = sorted((p for p in out_dir.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts))
    try:
        for folder in [*folders, out_dir]:
            folder.rmdir()
    except OSError:
        raise ConfigError(
            f"output directory '{out_dir}' gained files while autopart replaced it; they are kept, and the "
            "new output is not written: choose a new or empty directory for -o"
        ) from None
