"""Whether a plan leaves its GPU room beyond what the memory model counts.

The memory model counts tensors (what ``torch.cuda.max_memory_allocated`` shows), and beside
them the CUDA context and the collective library's buffers (`cost_models.memory`). The caching
allocator reserves more than the tensors: it rounds each block up and keeps freed blocks that a
later request may not fit. Expandable segments (`autopart.runtime.allocator`, which the
generated train.py turns on) keep the excess small, not nil, and it depends on the order of the
run's allocations, which no compile sees. So a plan that fits within a few percent of the
device's memory fits on paper and may not on the device; the compile says so, and how to keep a
margin (``--memory``), rather than refuse a plan that may well run. A ``--memory`` of the user's
own is a budget they chose, margin or not, and gets no warning, unless it is above the device's
memory: ``--memory`` is an override (a device of more memory than its spec says), and a plan
beyond the named device's memory cannot run on that device, so the compile says so.
"""

from __future__ import annotations

import math

from autopart.ir.plan import Plan

__all__ = ["ALLOCATOR_MARGIN", "headroom_warning", "over_device_warning"]

ALLOCATOR_MARGIN = 0.05
"""The share of a GPU's memory below which what a plan leaves free earns a warning: a judgement,
not a measurement, about what the caching allocator may hold beyond the tensors."""


def headroom_warning(plan: Plan, *, device_bytes: int, kind: str, budget_chosen: bool) -> str | None:
    """A line for a plan on an accelerator (``kind`` "cuda" or "rocm") whose fullest device
    leaves less than `ALLOCATOR_MARGIN` of the device's memory, ``device_bytes``, free; None
    otherwise: on a CPU (whose allocator is the system's), and where the user gave the memory
    (``budget_chosen``, ``--memory``)."""
    need = max(plan.predicted.memory_bytes, default=0)
    if budget_chosen or kind not in ("cuda", "rocm") or need <= (1 - ALLOCATOR_MARGIN) * device_bytes:
        return None
    margin = math.floor((1 - ALLOCATOR_MARGIN) * device_bytes / (1 << 30) * 100) / 100
    return (f"the fullest device needs {need / (1 << 30):.2f} of its {device_bytes / (1 << 30):.2f} GiB, which leaves "
            f"the caching allocator less than {ALLOCATOR_MARGIN:.0%} of it beyond what the memory model counts "
            f"(train.py turns on its expandable segments to keep what it needs small); for a margin, compile with "
            f"--memory {margin:g}")


def over_device_warning(plan: Plan, *, device_bytes: int, device_name: str, memory_gib: float | None) -> str | None:
    """A line for a plan compiled under a ``--memory`` (``memory_gib``) above ``device_bytes``,
    the named device's memory, whose fullest device needs more than that memory; None otherwise."""
    need = max(plan.predicted.memory_bytes, default=0)
    if memory_gib is None or need <= device_bytes:
        return None
    return (f"the fullest device needs {need / (1 << 30):.2f} GiB, more than the {device_bytes / (1 << 30):.2f} GiB "
            f"of a {device_name}: --memory {memory_gib:g} let the plan through, and it will not fit on that device "
            f"(compile without --memory for a plan that fits it, or for a device that has the memory)")
