"""Time of collectives and point-to-point messages, in the form nccl-tests reports them.

nccl-tests measures an algorithm bandwidth (message bytes / time) and converts it to a *bus*
bandwidth with a per-collective factor, so that one link figure describes every collective:

    time = step_latency · steps + nbytes · factor / bus_bandwidth

with, for a group of n ranks (ring algorithms):

    collective       factor      steps
    all_reduce       2(n−1)/n    2(n−1)   (reduce-scatter, then all-gather)
    all_gather       (n−1)/n     n−1
    reduce_scatter   (n−1)/n     n−1
    all_to_all       (n−1)/n     n−1
    broadcast        1           n−1      (pipelined along the ring)
    reduce           1           n−1

``nbytes`` is nccl-tests' "size": the buffer each rank holds for all_reduce, broadcast and
reduce; the whole gathered output for all_gather; the whole input for reduce_scatter; the
whole send buffer for all_to_all. A group of one rank moves nothing and costs nothing.
"""

from __future__ import annotations

__all__ = ["COLLECTIVE_KINDS", "bus_factor", "ring_steps", "collective_time", "p2p_time"]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                    "reduce")


def _check(kind: str, group_size: int) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective '{kind}'; use one of {', '.join(COLLECTIVE_KINDS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")


def bus_factor(kind: str, group_size: int) -> float:
    """nccl-tests' bus bandwidth factor: bytes on the busiest link per byte of message."""
    _check(kind, group_size)
    n = group_size
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ring_steps(kind: str, group_size: int) -> int:
    """Latency-bound steps of the ring algorithm, each paying one link latency."""
    _check(kind, group_size)
    return 2 * (group_size - 1) if kind == "all_reduce" else group_size - 1


def collective_time(kind: str, nbytes: float, group_size: int, *, bus_bandwidth: float,
                    step_latency_s: float) -> float:
    """Seconds for one collective; see the module docstring for the formula."""
    _check(kind, group_size)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if group_size == 1:
        return 0.0
    return (step_latency_s * ring_steps(kind, group_size)
            + nbytes * bus_factor(kind, group_size) / bus_bandwidth)


def p2p_time(nbytes: float, *, bandwidth: float, latency_s: float) -> float:
    """Seconds for one message: one latency, then the bytes at link speed; nothing for 0 bytes."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return 0.0 if nbytes == 0 else latency_s + nbytes / bandwidth
