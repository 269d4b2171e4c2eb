"""The machine a process runs on, as the checks of every layer read it: the compiler's (an example
batch it would build), the cost models' (a CPU's device spec) and the profiler's."""

from __future__ import annotations

import os
from pathlib import Path

from autopart.ir.errors import DeviceSpecError

__all__ = ["physical_memory_bytes"]


def physical_memory_bytes() -> int:
    """Total RAM of this machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise DeviceSpecError("cannot read this machine's physical memory; copy cpu.toml, set "
                          "calibrate = false and state memory_bytes and the other figures")
