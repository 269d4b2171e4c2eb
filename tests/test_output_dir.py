"""``compile -o OUT`` replaces only what autopart wrote: a user's file, a folder autopart did not
make, or a symbolic link out of OUT stops the compile with one line, and nothing is deleted."""

import json
from pathlib import Path

import pytest

from autopart.tools import cli
from autopart.codegen.output_dir import MARKER, check_output_directory, remove_output, write_marker
from autopart.ir.errors import ConfigError
from tests.distributed import REPO

GPT = str(REPO / "examples" / "gpt.py")


def refused(capsys, out: Path) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compile", GPT, "-o", str(out), "--pp", "2", "--microbatches", "2", "--time-limit", "5"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopart: error: "), lines
    return lines[0]


def test_a_folder_with_a_thesis_and_an_empty_plan_json_is_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "that-folder"
    out.mkdir()
    (out / "thesis.txt").write_text("four years of work")
    (out / "plan.json").write_text("")
    line = refused(capsys, out)
    assert f"'{out}' holds files but no {MARKER}" in line
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "thesis.txt"]
    assert (out / "thesis.txt").read_text() == "four years of work"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".that-folder")]


def fake_output(out: Path) -> None:
    """An output directory as a compile leaves it, without compiling: plan, a stage, the marker."""
    (out / "stages").mkdir(parents=True)
    (out / "plan.json").write_text("{}")
    (out / "stages" / "stage_0.py").write_text("STAGE = None\n")
    write_marker(out)


def test_a_symbolic_link_in_out_pointing_outside_is_refused_and_its_target_survives(tmp_path, capsys):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_text("keep me")
    out = tmp_path / "out"
    fake_output(out)
    (out / "stages" / "link").symlink_to(outside)
    line = refused(capsys, out)
    assert "holds the symbolic link stages/link, which autopart never writes" in line
    assert (outside / "data.bin").read_text() == "keep me"
    assert (out / "stages" / "link").is_symlink() and (out / "plan.json").exists()
    with pytest.raises(ConfigError, match="symbolic link"):
        remove_output(out)  # the removal itself checks again
    assert (outside / "data.bin").read_text() == "keep me"


def test_out_that_is_itself_a_link_is_refused(tmp_path, capsys):
    target = tmp_path / "real"
    fake_output(target)
    (tmp_path / "out").symlink_to(target)
    assert "is a symbolic link" in refused(capsys, tmp_path / "out")
    assert (target / "plan.json").exists()


@pytest.mark.parametrize("extra", ["notes.txt", "stages/mine.py", "weights/old.safetensors"])
def test_a_file_beside_autopart_s_own_is_refused(tmp_path, extra):
    out = tmp_path / "out"
    fake_output(out)
    (out / extra).parent.mkdir(exist_ok=True)
    (out / extra).write_text("mine")
    with pytest.raises(ConfigError, match=f"holds other files \\(first {extra}\\)"):
        check_output_directory(out)
    assert (out / extra).read_text() == "mine"


def test_autopart_s_own_directory_is_replaced_with_its_bytecode(tmp_path, capsys):
    out = tmp_path / "out"
    fake_output(out)
    (out / "stages" / "__pycache__").mkdir()
    (out / "stages" / "__pycache__" / "stage_0.cpython-312.pyc").write_bytes(b"")  # Python's, from a run
    cli.main(["compile", GPT, "-o", str(out), "--pp", "2", "--microbatches", "2", "--time-limit", "5"])
    marker = json.loads((out / MARKER).read_text())
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted([*marker["files"], MARKER]) == written and "stages/stage_1.py" in written
    assert not (out / "stages" / "__pycache__").exists()
    check_output_directory(out)  # a second compile may replace it again
    remove_output(out)
    assert not out.exists()


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path, capsys, monkeypatch):
    """Where the system refuses the folder (no permission, a read-only disk), the compile says so in
    its line; root on this machine may write anywhere, so the refusal is the system's stand-in."""
    from autopart.codegen import emit

    def refuse(**_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(emit.tempfile, "mkdtemp", refuse)
    line = refused(capsys, tmp_path / "out")
    assert f"cannot write the output directory '{tmp_path / 'out'}' (Permission denied)" in line
    assert not (tmp_path / "out").exists()


def test_a_folder_this_user_may_not_write_in_is_refused_before_the_compile(tmp_path, capsys, monkeypatch):
    """Checked before the search, where the output directory is only written after it; the
    folder above -o counts even where -o exists, since the output is made beside it."""
    from autopart.runtime import output_paths

    real_access = output_paths.os.access
    monkeypatch.setattr(output_paths.os, "access", lambda p, mode: Path(p) != tmp_path and real_access(p, mode))
    (tmp_path / "out").mkdir()
    line = refused(capsys, tmp_path / "out")
    assert f"-o {tmp_path / 'out'}: this user may not write in {tmp_path}" in line


def test_the_output_is_as_readable_as_the_umask_makes_a_user_s_files(tmp_path, capsys):
    """tempfile makes its folder 0700 and safetensors its files 0600: on a shared file system the
    other users and jobs that train from OUT could read none of it."""
    import os

    mask = os.umask(0o027)
    try:
        cli.main(["compile", GPT, "-o", str(tmp_path / "out"), "--pp", "2", "--microbatches", "2", "--no-measure"])
    finally:
        os.umask(mask)
    capsys.readouterr()
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "out" / "weights" / "stage_0.safetensors").stat().st_mode & 0o777 == 0o640
