"""How long a measuring loop runs: its own span, or less where the user caps every span.

Each loop that times something on this machine (ops in place, the optimizer's step, copies of
the model computing at once, a plan's steps in ``--profile-pipeline``) runs for seconds, not for
a count of runs: this machine's speed moves within seconds, and a figure should be the mean
over that. ``AUTOPART_MEASURE_SECONDS=S`` caps every such span at S seconds, for a quick first
look (or a test suite that checks what is measured, not how well): the figures rest on fewer
samples and move more between runs. The loops' counts of runs stay as they are, and so do the
short bounds inside a loop (a co-run's phases of a fraction of a second, its warm-up).
"""

from __future__ import annotations

import math
import os

from autopart.ir.errors import ConfigError

__all__ = ["MEASURE_SECONDS_ENV", "span", "timed_run"]

MEASURE_SECONDS_ENV = "AUTOPART_MEASURE_SECONDS"


def span(seconds: float) -> float:
    """``seconds``, or the cap in ``$AUTOPART_MEASURE_SECONDS`` where that is smaller."""
    text = os.environ.get(MEASURE_SECONDS_ENV, "").strip()
    if not text:
        return seconds
    try:
        cap = float(text)
    except ValueError:
        cap = math.nan
    if not cap >= 0:  # NaN too
        raise ConfigError(f"{MEASURE_SECONDS_ENV}={text!r} is not a number of seconds; "
                          f"set it to a span such as 0.5, or unset it to measure for the full spans")
    return min(seconds, cap)


def timed_run(seconds: float, *, warmup: int, least: int, most: int) -> list[str]:
    """``train.py``'s arguments for a run that times a plan's steps: ``warmup`` steps to leave out,
    then at least ``least`` and at most ``most`` more, stopping once those took ``seconds`` (by
    `span`) together (``--seconds``: every rank stops after the same step). A bound in seconds,
    not a count of steps by the plan's prediction: a prediction made before the plan ran is the
    figure the run is there to correct, and a count by it ran for too long or too few."""
    return ["--steps", str(warmup + most), "--min-steps", str(warmup + least), "--untimed-steps", str(warmup),
            "--seconds", repr(span(seconds))]
