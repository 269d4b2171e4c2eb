"""A counter, installed in each rank by the tests, of the host's waits for the device that the
runtime makes in each step: ``device.synchronize``, and every read of a tensor's value
(``.item()``, ``.tolist()``, ``float()``, ``int()``, ``bool()``) made by autopart's own code.

On a GPU each of them stops the host until the kernels queued before it have run, so that the
device idles while the host then prepares what follows; on the CPU they cost nothing, and a run
on the CPU cannot tell them from any other call. The counts can: the tests bound them per step.
Reads made by torch itself (an optimizer's step counters, on the host on a GPU machine too) are
not the runtime's and are not counted, nor those of the batches as they are drawn, on the host on
every machine.

Installed by ``tests/rank_zygote.py`` when a rank's environment has ``AUTOPART_HOST_READS=FILE``;
at ``destroy_process_group`` the rank appends to FILE one line, ``{"rank": r, "steps": [counts of
each step]}``, a step being what the rank did from one `StepTimer` to the next.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from autopart.runtime import device

__all__ = ["install", "READS"]

READS = ("item", "tolist", "__float__", "__int__", "__bool__")
_HOST_ONLY = {"autopart.runtime.data"}  # the batches, drawn on the host on every machine


def install(report: Path) -> None:
    """Count each step's synchronizes and the runtime's reads of tensor values."""
    steps: list[Counter] = [Counter()]  # what came before the first step, then one per step

    def counted(name: str, call):
        @functools.wraps(call)
        def count(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("autopart.") and caller not in _HOST_ONLY:
                steps[-1][name] += 1
            return call(*args, **kwargs)

        return count

    for name in READS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    device.synchronize = counted("synchronize", device.synchronize)
    start = device.StepTimer.__init__

    @functools.wraps(start)
    def step_begins(self, *args, **kwargs):
        steps.append(Counter())
        start(self, *args, **kwargs)

    device.StepTimer.__init__ = step_begins
    destroy = dist.destroy_process_group

    def destroy_and_report(*args, **kwargs):
        with open(report, "a") as file:
            file.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "steps": steps[1:]}) + "\n")
        return destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_and_report
