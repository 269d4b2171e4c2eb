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

A group that spans several nodes moves its bytes over the network, the slowest link of its
rings. NCCL lays its rings (channels) through every NIC of the group's GPUs on a node, so a group
with r members on each node crosses between nodes at r NICs' bandwidth (nccl-tests' bus bandwidth
on nodes of 8 H100s, 8 NDR NICs, is 8 NICs' worth, not one's), up to NVLink's; an all-to-all sends
each rank's bytes through its own NIC. NCCL's tuning model (``src/graph/tuning.cc``) charges the
network's latency only on the ring steps that cross a node boundary, ``nodes − 1`` of them (twice
that for all_reduce); the other steps go over NVLink at its latency. A ring of 512 ranks on 64
nodes so pays 63 network latencies an all-gather, not 511.

An all-reduce over several nodes has a second algorithm, which NCCL picks where its model finds it
faster: a double binary tree (`tree_all_reduce_time`). Its latency grows with the log of the nodes
(a chain through each node's members, then the tree between nodes, up and down), where the
ring's grows with the ranks, so at hundreds of data-parallel ranks with small buckets the tree is
many times faster; its bandwidth is a little below the ring's and, for medium messages, well
below. The all-reduce costs the faster of the two.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import NamedTuple

__all__ = ["COLLECTIVE_KINDS", "bus_factor", "ring_steps", "node_steps", "node_members", "nodes_spanned",
           "fewest_members", "NodeSpan", "node_span", "collective_time", "tree_all_reduce_time", "p2p_time"]

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


def node_steps(kind: str, group_size: int, nodes: int) -> int:
    """Of the ring's steps, those that cross a node boundary: the ring enters each of ``nodes``
    nodes once (NCCL's ``nInterSteps`` for all_gather, reduce_scatter and all_reduce; NCCL charges
    broadcast and reduce one more, which this leaves out); an all-to-all sends to every rank off
    its own node."""
    _check(kind, group_size)
    if not 1 <= nodes <= group_size:
        raise ValueError(f"a group of {group_size} ranks spans 1 to {group_size} nodes, got {nodes}")
    if kind == "all_to_all":
        return group_size - group_size // nodes
    return 2 * (nodes - 1) if kind == "all_reduce" else nodes - 1


def node_members(kind: str, group_size: int, nodes: int, fewest: int | None = None) -> int:
    """The NICs a group's traffic between nodes spreads over, per node: its members on the node
    that holds the fewest (``fewest``, `fewest_members`), since every byte that leaves or enters
    that node goes through their NICs alone (6 ranks on one node and 2 on the next cross at 2
    NICs' bandwidth, not 4); None takes them as even, ``group_size // nodes``, exact where the
    group fills its nodes alike. One for an all-to-all, whose every rank sends its own bytes off
    its node."""
    _check(kind, group_size)
    if kind == "all_to_all":
        return 1
    return max(1, group_size // nodes if fewest is None else fewest)


@functools.lru_cache(maxsize=None)
def nodes_spanned(group_size: int, stride: int, gpus_per_node: int, world_size: int | None = None) -> int:
    """The most nodes that one group of a mesh axis spans: its ``group_size`` ranks ``stride``
    apart, the axis's groups starting at every rank whose index on the axis is 0 (in blocks of
    ``group_size * stride`` ranks, ``stride`` groups interleaved in each, as many blocks as
    ``world_size`` holds; None: as many as make a difference), ranks filling nodes of
    ``gpus_per_node`` in order (torchrun's placement). A tensor-parallel group has stride 1, a
    data-parallel group the ranks of one replica; a group whose size does not divide a node's
    GPUs may straddle two nodes."""
    return max(len(members) for members in _members_by_node(group_size, stride, gpus_per_node, world_size))


def fewest_members(group_size: int, stride: int, gpus_per_node: int, world_size: int | None = None) -> int:
    """Of the groups of a mesh axis laid out as `nodes_spanned` lays them, those spanning several
    nodes, the fewest members that one holds on any node (the whole group where none spans
    several): the NICs its traffic between nodes is narrowed to (`node_members`). The slowest
    group bounds the step, so the axis is priced by it: 8 ranks on nodes of 6 lie 6 + 2 (then
    4 + 4), and cross at 2 NICs' bandwidth."""
    spread = [members for members in _members_by_node(group_size, stride, gpus_per_node, world_size) if len(members) > 1]
    return min((min(members) for members in spread), default=group_size)


class NodeSpan(NamedTuple):
    """How the groups of a mesh axis lie on the nodes, as their collectives are priced: the most
    nodes one spans (`nodes_spanned`) and the fewest members one holds on a node (`fewest_members`)."""

    nodes: int
    fewest: int


def node_span(group_size: int, stride: int, gpus_per_node: int, world_size: int | None = None) -> NodeSpan:
    """`NodeSpan` of the axis's groups of ``group_size`` ranks ``stride`` apart (as `nodes_spanned`)."""
    return NodeSpan(nodes_spanned(group_size, stride, gpus_per_node, world_size),
                    fewest_members(group_size, stride, gpus_per_node, world_size))


@functools.lru_cache(maxsize=None)
def _members_by_node(group_size: int, stride: int, gpus_per_node: int, world_size: int | None
                     ) -> tuple[tuple[int, ...], ...]:
    """Per group of the axis (up to where the placement repeats), its members on each node it
    spans: what `nodes_spanned` and `fewest_members` read, so kept for both."""
    if min(group_size, stride, gpus_per_node) < 1:
        raise ValueError(f"group size, stride and GPUs per node must be >= 1, got {group_size}, {stride}, {gpus_per_node}")
    if stride >= gpus_per_node:
        return ((1,) * group_size,)  # each member on a node of its own
    block, g = group_size * stride, gpus_per_node
    blocks = g if world_size is None else max(1, min(g, world_size // block))  # past g blocks the nodes repeat
    starts = {(b * block + offset) % g for b in range(blocks) for offset in range(stride)}
    return tuple(tuple(Counter((start + k * stride) // g for k in range(group_size)).values()) for start in sorted(starts))


def collective_time(kind: str, nbytes: float, group_size: int, *, bus_bandwidth: float,
                    step_latency_s: float, nodes: int = 1, node_step_latency_s: float = 0.0,
                    trees: bool = True) -> float:
    """Seconds for one collective; see the module docstring for the formula. Over several
    ``nodes``, the steps that cross a node boundary pay ``node_step_latency_s`` instead; an
    all-reduce there takes the tree where it is faster, where the library has one (``trees``:
    NCCL and RCCL, not gloo)."""
    _check(kind, group_size)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if group_size == 1:
        return 0.0
    crossing = node_steps(kind, group_size, nodes)
    ring = (step_latency_s * (ring_steps(kind, group_size) - crossing) + node_step_latency_s * crossing
            + nbytes * bus_factor(kind, group_size) / bus_bandwidth)
    if kind != "all_reduce" or nodes == 1 or not trees:  # NCCL runs its trees for all-reduce alone, across nodes
        return ring
    return min(ring, tree_all_reduce_time(nbytes, group_size, bus_bandwidth=bus_bandwidth, nodes=nodes,
                                          step_latency_s=step_latency_s, node_step_latency_s=node_step_latency_s))


TREE_BANDWIDTH_SHARE = 0.92
"""Of the ring's bus bandwidth, what NCCL's model gives its all-reduce tree (``tuning.cc``)."""

TREE_SIZE_SHARES = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)
"""A further share of the tree's bandwidth by message size, for 64 B·2**i up to 64 B·2**(i + 1)
(1 from 512 MiB): NCCL's own correction of its model for the Simple protocol, from its
measurements (``treeCorrectionFactor`` in ``tuning.cc``), since trees fall short of it for medium
sizes (a 25 MB data-parallel bucket: 0.7)."""


def tree_all_reduce_time(nbytes: float, group_size: int, *, bus_bandwidth: float, nodes: int,
                         step_latency_s: float, node_step_latency_s: float) -> float:
    """Seconds for an all-reduce by NCCL's double binary tree over ``nodes`` nodes: up the tree and
    down again, each way through a chain of a node's members (``group_size / nodes`` of them) and
    ``floor(log2(nodes))`` levels between nodes, as NCCL's tuning model charges it; each rank moves
    the whole buffer up and down (an algorithm bandwidth of half the bus bandwidth, whatever the
    group's size), at ``TREE_BANDWIDTH_SHARE`` and ``TREE_SIZE_SHARES`` of the ring's.

    Where the share steps up at a size class's start, a larger message would take less time than
    a smaller one just below it; a message takes no less than any larger one, as a sender could
    pad it (the search's bounds count on time growing with bytes)."""
    _check("all_reduce", group_size)
    if group_size == 1:
        return 0.0
    per_node = max(1, group_size // nodes)
    latency = 2 * ((per_node - 1) * step_latency_s + (nodes.bit_length() - 1) * node_step_latency_s)
    starts = [64 << k for k in range(_size_class(nbytes) + 1, len(TREE_SIZE_SHARES) + 1)]  # the larger classes'
    return latency + min(2 * size / (bus_bandwidth * TREE_BANDWIDTH_SHARE * _tree_share(size))
                         for size in (nbytes, *starts))


def _size_class(nbytes: float) -> int:
    """NCCL's index into its correction: ``log2(nbytes / 64)``, rounded down (0 below 128 B)."""
    return max(0, (int(nbytes) >> 6).bit_length() - 1)


def _tree_share(nbytes: float) -> float:
    size_class = _size_class(nbytes)
    return TREE_SIZE_SHARES[size_class] if size_class < len(TREE_SIZE_SHARES) else 1.0


def p2p_time(nbytes: float, *, bandwidth: float, latency_s: float) -> float:
    """Seconds for one message: one latency, then the bytes at link speed; nothing for 0 bytes."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return 0.0 if nbytes == 0 else latency_s + nbytes / bandwidth
