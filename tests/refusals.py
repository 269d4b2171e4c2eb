"""What every bad-input test checks of a refusal: exit code 2, one line that starts
``autopart: error:``, no traceback, and every file it could touch as it was."""

import hashlib
from pathlib import Path

import pytest

from autopart.tools import cli

__all__ = ["snapshot", "refused", "call_cli", "assert_nothing_written"]


def snapshot(*folders: Path) -> dict[Path, str]:
    """Every file under ``folders`` with the hash of its bytes (Python's bytecode caches aside)."""
    return {
        path: hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in folders for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def refused(capsys, run, *watch: Path) -> str:
    """``run()`` must exit 2 with one line and no traceback, and leave every file of ``watch`` as it was."""
    before = snapshot(*watch)
    with pytest.raises(SystemExit) as exit_info:
        run()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, repr(err)  # no empty line either (a progress bar's)
    assert lines[0].startswith("autopart: error: ")
    assert snapshot(*watch) == before, "a file was written, changed or deleted"
    return lines[0]


def call_cli(capsys, *argv: str, watch: tuple[Path, ...] = ()) -> str:
    """Run the command line in this process; return its one stderr line, having checked the contract."""
    return refused(capsys, lambda: cli.main(list(argv)), *watch)


def assert_nothing_written(folder: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in folder.iterdir() if p.name.startswith(f".{out.name}")], "a partial output was left"
