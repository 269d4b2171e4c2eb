"""The errors that autopart raises for a user's mistake.

Every one of them is a contract: the message is one line that says what is wrong and what to
do about it. The command line prints it as ``autopart: error: <message>`` and exits with code 2,
without a traceback. ``assert`` is kept for autopart's own invariants.
"""

import argparse
import math
import sys
from pathlib import Path

__all__ = [
    "OneLineParser",
    "AutopartError",
    "ModelFileError",
    "CaptureError",
    "ConfigError",
    "PrecisionError",
    "InfeasibleError",
    "PlanError",
    "ScheduleError",
    "DeviceSpecError",
    "CheckpointError",
    "gib_up",
    "gib_beside",
    "read_user_file",
]


class AutopartError(Exception):
    """Base class of every error caused by the user's input."""


class ModelFileError(AutopartError):
    """The model file is missing, does not import, or breaks the model-file contract."""


class CaptureError(AutopartError):
    """The model and loss could not be captured into one graph."""


class ConfigError(AutopartError):
    """The options do not fit together or do not fit the model."""


class PrecisionError(ConfigError):
    """The model does not run in the precision asked for (autopart.passes.annotate.mixed_dtype_error);
    a search that may choose another leaves this one out."""


class InfeasibleError(AutopartError):
    """No plan satisfies the memory budget."""


class PlanError(AutopartError):
    """A plan.json is malformed or belongs to another model."""


class ScheduleError(AutopartError):
    """A pipeline schedule is invalid (a missing action, a broken dependency, a deadlock)."""


class DeviceSpecError(AutopartError):
    """A device name is unknown or its spec file is malformed."""


class CheckpointError(AutopartError):
    """A checkpoint is missing, damaged, or holds what autopart never saves (a crafted metadata pickle)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes end like every other user error: one line, exit code 2 (argparse's
    own prints the whole usage first), for ``autopart`` and for the generated ``train.py`` alike."""

    def error(self, message: str) -> None:
        print(f"autopart: error: {message}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(2)


def read_user_file(path: str | Path, error: type[AutopartError], what: str, fix: str) -> bytes:
    """The bytes of a file the user named (``what``: "plan file"). One that is there but cannot be
    read (a folder, a file without read permission, a failing disk) is ``error``, one line that names
    it and says why and what to do (``fix``), where the OSError would end the command in a traceback."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise error(f"{what} '{path}' cannot be read ({exc.strerror or exc}); {fix}") from None


def gib_up(nbytes: int, figures: int = 4) -> str:
    """GiB to ``figures`` significant figures, rounded up: a memory limit that a message may tell
    the user to pass, and that fits."""
    value = nbytes / (1 << 30)
    scale = 10 ** (figures - 1 - math.floor(math.log10(value))) if value > 0 else 1
    return f"{math.ceil(value * scale) / scale:g}"


def gib_beside(need_bytes: int, limit_bytes: int) -> tuple[str, str]:
    """A need above a limit, both in GiB, to as many figures as it takes to tell them apart (two
    decimals printed "needs 0.80 GiB but the limit is 0.80 GiB; raise --memory to at least 0.80")."""
    for figures in (4, 6, 9):
        need, limit = gib_up(need_bytes, figures), f"{limit_bytes / (1 << 30):.{figures}g}"
        if float(need) > float(limit):
            break
    return need, limit
