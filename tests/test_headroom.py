"""A GPU plan that leaves its device less than ALLOCATOR_MARGIN free compiles, with a warning
that says how to keep a margin; a plan with room, and one under a --memory the user lowered, get
none."""

import contextlib
import io
import re

import pytest

from autopart.predict.headroom import ALLOCATOR_MARGIN
from autopart.tools import cli
from cost_models.devices import DEVICES_DIR
from tests.distributed import REPO

H100 = (DEVICES_DIR / "h100-sxm.toml").read_text()
GIB = 1 << 30


def _compile(tmp_path, capsys, memory_bytes: int, *extra: str) -> tuple[str, str]:
    spec = tmp_path / "small.toml"
    spec.write_text(re.sub(r"memory_bytes = [\d_]+", f"memory_bytes = {memory_bytes}", H100)
                    .replace('name = "h100-sxm"', 'name = "small"'))
    cli.main(["compile", str(REPO / "examples" / "llama.py"), "-o", str(tmp_path / "out"), "--pp", "2",
              "--dtype", "bf16", "--device", str(spec), *extra])
    captured = capsys.readouterr()
    return captured.out, captured.err


def _need(out: str) -> float:
    """The fullest stage's memory GiB, from the compile's stage table."""
    rows = [line.split("│") for line in out.splitlines() if line.startswith("│") and "stage" not in line]
    return max(float(row[5]) for row in rows)


@pytest.fixture(scope="module")
def need_gib(tmp_path_factory) -> float:
    tmp_path = tmp_path_factory.mktemp("roomy")
    spec = tmp_path / "roomy.toml"
    spec.write_text(H100)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main(["compile", str(REPO / "examples" / "llama.py"), "-o", str(tmp_path / "out"), "--pp", "2",
                  "--dtype", "bf16", "--device", str(spec)])
    return _need(printed.getvalue())


def test_a_tight_plan_is_warned_with_the_margin_to_give(tmp_path, capsys, need_gib):
    device = round(need_gib * GIB / (1 - ALLOCATOR_MARGIN / 2))  # fits, with half the margin
    _, err = _compile(tmp_path, capsys, device)
    lines = [line for line in err.splitlines() if line.startswith("autopart: warning: ")]
    assert len(lines) == 1, err
    suggested = float(re.search(r"compile with --memory ([\d.]+)$", lines[0]).group(1))
    assert suggested <= (1 - ALLOCATOR_MARGIN) * device / GIB < suggested + 0.01, lines[0]
    assert f"of its {device / GIB:.2f} GiB" in lines[0]


def test_a_plan_with_room_or_a_chosen_budget_is_not_warned(tmp_path, capsys, need_gib):
    device = round(need_gib * GIB / (1 - 2 * ALLOCATOR_MARGIN))
    _, err = _compile(tmp_path, capsys, device)
    assert "warning" not in err, err
    tight = round(need_gib * GIB / (1 - ALLOCATOR_MARGIN / 2))  # warned above, without --memory
    _, err = _compile(tmp_path, capsys, tight, "--memory", f"{need_gib * 1.01:.4f}")
    assert "warning" not in err, err


def test_a_memory_above_the_device_s_own_warns_that_the_plan_will_not_fit_on_it(tmp_path, capsys, need_gib):
    """``--memory`` overrides the device's memory: a plan it lets through beyond what the named
    device has compiles, with a line that says it will not fit there."""
    device = round(need_gib * GIB / 2)  # half what the plan needs
    _, err = _compile(tmp_path, capsys, device, "--memory", f"{2 * need_gib:.4f}")
    lines = [line for line in err.splitlines() if line.startswith("autopart: warning: ")]
    assert len(lines) == 1, err
    assert f"more than the {device / GIB:.2f} GiB of a small" in lines[0]
    given = float(re.search(r"--memory ([\d.]+) let the plan through", lines[0]).group(1))
    assert given == pytest.approx(2 * need_gib, abs=1e-3) and "will not fit on that device" in lines[0]
    _, err = _compile(tmp_path, capsys, round(need_gib * GIB * 1.5), "--memory", f"{2 * need_gib:.4f}")
    assert "warning" not in err, err  # the plan fits the device: the budget above it is the user's own
