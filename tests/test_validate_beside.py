"""A large plan's schedule validated in a forked process while the compile goes on
(`autopart.schedule.validation_beside`), and waited for where the schedule is first taken
(`autopart.schedule.generated`); with `autopart.ir.forked.Forked`, on which it and the report rest."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from autopart.ir.errors import ScheduleError
from autopart.ir.forked import Forked
from autopart.schedule import stored
from autopart.schedule.stored import generated, validation_beside

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the validation is forked on Linux")

LARGE = ("1f1b", 16, 640, 1)  # 20,480 compute actions (a forward and a backward each): FORK_FROM_ACTIONS


@pytest.fixture(autouse=True)
def fresh_cache():
    """Each test sees its shapes unvalidated, and leaves nothing begun for the next."""
    generated.cache_clear()
    stored._validated.clear()
    stored._beside.clear()
    yield
    for pending in stored._beside.values():
        pending.stop()
    stored._beside.clear()
    generated.cache_clear()
    stored._validated.clear()


def _only_this_cpu_is_local(monkeypatch) -> None:
    """A named GPU is never the machine at hand here, even on a host that has one."""
    from autopart import driver
    from autopart.solve import planner

    for module in (driver, planner):
        monkeypatch.setattr(module, "local_kind", lambda device: "cpu" if device == "cpu" else None)


def _record_pid(folder: Path):
    real = stored._check_generated

    def check(*shape) -> None:
        with open(folder / f"checked-{os.getpid()}", "a") as record:  # one line per shape this process checked
            record.write(f"{shape!r}\n")
        real(*shape)

    return check


def test_a_large_schedule_is_validated_in_another_process_and_taken_as_before(tmp_path, monkeypatch):
    assert stored.compute_actions(*LARGE) == 20_480 >= stored.FORK_FROM_ACTIONS
    monkeypatch.setattr(stored, "_check_generated", _record_pid(tmp_path))
    with validation_beside(*LARGE):
        assert LARGE in stored._beside
        beside = generated(*LARGE)
        assert not stored._beside
    (record,) = tmp_path.iterdir()
    assert int(record.name.removeprefix("checked-")) != os.getpid() and record.read_text() == f"{LARGE!r}\n"
    generated.cache_clear()
    with validation_beside(*LARGE):  # validated already in this process: nothing begun
        assert not stored._beside
    stored._validated.clear()
    here = generated(*LARGE)  # no validation beside: validated in this process
    assert (tmp_path / f"checked-{os.getpid()}").exists()
    assert here.lists == beside.lists and here.placement == beside.placement


def test_a_small_schedule_or_a_compile_that_times_this_machine_validates_where_it_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "_check_generated", _record_pid(tmp_path))
    with validation_beside("1f1b", 2, 4, 1):
        assert not stored._beside
        generated("1f1b", 2, 4, 1)
    with validation_beside(*LARGE, fork=False):  # a process beside it would be counted in what it measures
        assert not stored._beside
        generated(*LARGE)
    assert [p.name for p in tmp_path.iterdir()] == [f"checked-{os.getpid()}"]


def test_what_the_block_did_not_take_is_stopped_as_it_ends(monkeypatch):
    monkeypatch.setattr(stored, "_check_generated", lambda *shape: time.sleep(60))
    started = time.monotonic()
    with pytest.raises(ValueError, match="the capture failed"):
        with validation_beside(*LARGE):
            (running,) = stored._beside.values()
            raise ValueError("the capture failed")
    assert not stored._beside and time.monotonic() - started < 10
    assert running._process is None  # stopped and joined: no process left behind


def test_a_block_inside_one_for_the_same_shape_leaves_the_outer_one_s_validation_running(monkeypatch):
    """The search's loop opens a block before it captures, and `_plan_of` opens its own inside."""
    monkeypatch.setattr(stored, "_check_generated", lambda *shape: time.sleep(60))
    with validation_beside(*LARGE):
        (outer,) = stored._beside.values()
        with validation_beside(*LARGE):
            assert stored._beside == {LARGE: outer}
        assert stored._beside == {LARGE: outer} and outer._process is not None
    assert not stored._beside and outer._process is None


def test_a_validation_process_that_dies_or_cannot_start_is_done_where_it_is_taken(tmp_path, monkeypatch):
    compiling = os.getpid()

    def dies_beside(*shape) -> None:
        if os.getpid() != compiling:
            os._exit(9)  # as the kernel's out-of-memory killer would end it
        (tmp_path / "checked here").write_text("")

    monkeypatch.setattr(stored, "_check_generated", dies_beside)
    with validation_beside(*LARGE):
        assert LARGE in stored._beside
        generated(*LARGE)
    assert (tmp_path / "checked here").exists()

    def no_room(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    generated.cache_clear()
    stored._validated.clear()
    (tmp_path / "checked here").unlink()
    monkeypatch.setattr(stored, "Forked", no_room)
    with validation_beside(*LARGE):
        assert not stored._beside
        generated(*LARGE)
    assert (tmp_path / "checked here").exists()


def test_a_forked_copy_validates_itself_and_leaves_its_parent_s_validation_alone(tmp_path, monkeypatch):
    """A copy forked while a validation runs beside (the report's parts, a search's workers)
    inherits the table of what runs beside; its parent's pipe is not its own to read."""
    from autopart.ir.forked import Forked

    monkeypatch.setattr(stored, "_check_generated", _record_pid(tmp_path))
    with validation_beside(*LARGE):
        (parent_s,) = stored._beside.values()
        Forked(lambda: generated(*LARGE), what="a forked copy taking the schedule").wait()
        assert stored._beside == {LARGE: parent_s}
        generated(*LARGE)
    assert len(list(tmp_path.iterdir())) == 2  # the copy's own validation and the one beside the parent


def test_its_error_is_the_compile_s_one_line(monkeypatch):
    compiling = os.getpid()

    def broken(*shape) -> None:
        where = "beside" if os.getpid() != compiling else "here"
        raise ScheduleError(f"plan.schedule.actions: rank 3, position 7: 3B7 runs before 3F7 ({where})")

    monkeypatch.setattr(stored, "_check_generated", broken)
    with validation_beside(*LARGE):
        with pytest.raises(ScheduleError, match=r"^plan.schedule.actions: rank 3, position 7: 3B7 runs before 3F7 "
                                                r"\(beside\)$"):
            generated(*LARGE)
    monkeypatch.undo()
    assert generated(*LARGE).lists  # not kept as validated: the next call validates it again, here


@pytest.mark.parametrize(("device", "where"), [("a100-80gb", "beside"), ("cpu", "in the compile's process")])
def test_a_compile_with_a_bad_generated_schedule_fails_with_one_line_and_writes_nothing(device, where, tmp_path,
                                                                                        monkeypatch, capsys):
    """The fixed-layout path for a named GPU begins the validation before it captures (on this
    CPU, whose ops it times, it validates in its own process); the error reaches the command
    line as every input error does (exit 2, one line), and no output directory is left."""
    from autopart.tools import cli
    from tests.distributed import REPO

    compiling = os.getpid()

    def broken(*shape) -> None:
        where = "beside" if os.getpid() != compiling else "in the compile's process"
        raise ScheduleError(f"plan.schedule.actions: {shape} deadlocks (validated {where})")

    monkeypatch.setattr(stored, "FORK_FROM_ACTIONS", 0)
    monkeypatch.setattr(stored, "_check_generated", broken)
    _only_this_cpu_is_local(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(tmp_path / "out"), "--pp", "2",
                  "--microbatches", "4", "--time-limit", "5", "--device", device])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"autopart: error: plan.schedule.actions: ('1f1b', 2, 4, 1) deadlocks (validated {where})"]
    assert list(tmp_path.iterdir()) == []


def test_a_search_validates_its_plan_s_schedule_beside(tmp_path, monkeypatch):
    import autopart

    from tests.distributed import REPO

    monkeypatch.setattr(stored, "FORK_FROM_ACTIONS", 0)
    monkeypatch.setattr(stored, "_check_generated", _record_pid(tmp_path))
    _only_this_cpu_is_local(monkeypatch)
    plan = autopart.compile(REPO / "examples" / "gpt.py", world_size=8, device="a100-80gb", global_batch_size=64,
                            dtype="bf16")
    spec = plan.schedule
    chosen = repr((spec.kind, plan.mesh["pp"], spec.microbatches, spec.chunks))
    beside = [p for p in tmp_path.iterdir() if p.name != f"checked-{os.getpid()}"]
    assert chosen in {p.read_text().strip() for p in beside} and not stored._beside
    here = tmp_path / f"checked-{os.getpid()}"
    assert not here.exists() or chosen not in here.read_text().splitlines()  # the plan's shape not validated here too


def test_forked_raises_an_error_of_the_input_as_its_class_and_any_other_with_its_traceback():
    def bad_input() -> None:
        raise ScheduleError("rank 1 has no actions")

    def bug() -> None:
        raise KeyError("stage 9")

    with pytest.raises(ScheduleError, match="^rank 1 has no actions$"):
        Forked(bad_input, what="checking").wait()
    with pytest.raises(RuntimeError, match=r"(?s)^checking failed:\n.*Traceback.*KeyError: 'stage 9'"):
        Forked(bug, what="checking").wait()
    with pytest.raises(ScheduleError, match="^rank 1 has no actions$"):  # where it may not fork: here, at once
        Forked(bad_input, what="checking", fork=False)
