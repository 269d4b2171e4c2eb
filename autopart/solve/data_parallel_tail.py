"""The search's closed form of a layout's data-parallel collectives, per ZeRO level, placed where
the step model places them (``autopart.predict.data_parallel``, ``autopart.predict.reduction``).

- Levels 0 and 1 all-reduce the gradients in buckets as the last backward makes them final: on a
  device whose collectives run beside the compute (``Cluster.reduction_overlaps``), only what the
  all-reduce runs past the rank's last microbatch's backward, or slows it by, adds to the step. Level 1 then steps
  a shard of the optimizer state and all-gathers the updated shards (bf16 weights under ``bf16``,
  ``autopart.predict.data_parallel.gathered_bytes``).
- Level 2 (FSDP) reduce-scatters every microbatch's gradients beside the next action (hidden
  behind a forward's length) and gathers the parameters once a step; level 3 gathers them before
  every forward and every backward, a layer at a time beside the compute where collectives
  overlap it (``autopart.predict.fully_sharded``), which adds what they do not hide.
- Beside the compute, a collective slows it while it runs (``Cluster.overlap_slowdown``,
  ``autopart.predict.fully_sharded.slowing``), as the step model counts it.

The figures are the step model's on the search's own stage times (a stage's forward a third of
its forward and backward, as ``autopart.solve.search`` takes it elsewhere); a bucket's grain is
taken as the first block's parameters (what the backward makes final last, as the embedding).
Functions of plain values: the layout and cluster are read by attribute only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from autopart.predict.data_parallel import gathered_bytes
from autopart.predict.fully_sharded import Piece, added_beside, fully_sharded_cost
from autopart.runtime.fully_sharded import FSDP_LEVELS
from autopart.schedule import SPLIT_BACKWARD_KINDS, stage_placement
from autopart.solve.replica_shares import rank_spans, slowest_replica_bytes, trained_bytes
from autopart.solve.transfers import boundary_transfer_s
from cost_models.comm import NodeSpan

__all__ = ["fully_sharded_levels", "tail_s", "update_s", "exposed_all_reduce_s", "hidden_s", "last_bucket_bytes",
           "fully_sharded_extra_s", "layered_pending_s", "ranks_pending_s", "stage_layers", "stage_times",
           "most_hidden_s", "fsdp_may_pay", "fully_sharded_floor_s"]

FORWARD_SHARE = 1 / 3
"""Of a stage's forward and backward, the forward's part (a backward is about twice a forward)."""


def fully_sharded_levels(levels: tuple[int, ...], schedule: str) -> tuple[int, ...]:
    """The ZeRO levels of ``levels`` that ``schedule`` runs with: FSDP's (2 and 3) never with a
    split backward (``autopart.runtime.fully_sharded.check_level``)."""
    if schedule in SPLIT_BACKWARD_KINDS:
        return tuple(level for level in levels if level not in FSDP_LEVELS)
    return levels


def _reduce_scatter_s(cluster, nbytes: float, group: int, dp_span: NodeSpan) -> float:
    """A reduce-scatter moves what an all-gather moves (nccl-tests' bus factor (n - 1)/n both)."""
    return cluster.all_gather_s(nbytes, group, dp_span)


def tail_s(layout, cluster, rank_parameter_bytes: Sequence[int], dp_span: NodeSpan,
           hidden: Sequence[float] | None = None, last_bytes: Sequence[int] | None = None,
           stepped_bytes: Sequence[float] | None = None, trained_bytes: Sequence[float] | None = None,
           pending_s: Sequence[float] | None = None) -> float:
    """What the step does after the pipeline drains, on its busiest rank: the part of the
    data-parallel collectives that nothing hides, and the optimizer step (a shard of it under
    ZeRO). ``hidden``: per rank, the backward its all-reduce runs beside (``hidden_s``); None
    hides nothing. ``last_bytes``: per rank, the parameter bytes whose gradients are final only
    as its last backward ends (``last_bucket_bytes``): their all-reduce hides behind nothing.
    ``stepped_bytes``: per rank, what its slowest ZeRO-1 replica steps (`update_s`).
    ``trained_bytes``: per rank, the bytes of those parameters that train
    (`autopart.solve.replica_shares.trained_bytes`; None: all), all that it reduces and steps;
    FSDP gathers the frozen rest too. ``pending_s``: per rank, what its reduce-scatters run past
    its last backward (ZeRO-3's `layered_pending_s`); None: the whole of its bytes' (ZeRO-2's,
    which reduce-scatters a stage at once)."""
    tail = 0.0
    dp, level = layout.dp, int(layout.zero)
    for rank, whole in enumerate(rank_parameter_bytes):
        nbytes = whole if trained_bytes is None else trained_bytes[rank]
        if dp == 1 or level in (0, 1):
            sync = cluster.all_reduce_s(nbytes, dp, dp_span) if dp > 1 else 0.0
            if dp > 1 and hidden is not None and cluster.reduction_overlaps:
                last = cluster.all_reduce_s(last_bytes[rank], dp, dp_span) if last_bytes is not None else 0.0
                sync = exposed_all_reduce_s(sync, last, hidden[rank], cluster.overlap_slowdown)
            rank_tail = sync + update_s(layout, cluster, nbytes, dp_span,
                                        None if stepped_bytes is None else stepped_bytes[rank])
        else:  # FSDP: the step waits for the last reduce-scatter where it runs beside the compute
            last = _reduce_scatter_s(cluster, nbytes, dp, dp_span) if cluster.reduction_overlaps else 0.0
            if pending_s is not None:
                last = pending_s[rank]
            gather = cluster.all_gather_s(gathered_bytes(whole, layout.dtype), dp, dp_span) if level == 2 else 0.0
            rank_tail = cluster.optimizer_s_per_byte * nbytes / dp + last + gather
        tail = max(tail, rank_tail)
    return tail


def exposed_all_reduce_s(sync_s: float, last_s: float, hidden_s: float, slowdown: float) -> float:
    """What a rank's all-reduce of ``sync_s`` seconds adds to its step when all of it but the last
    bucket's ``last_s`` runs beside ``hidden_s`` seconds of its backward (which it slows by
    ``slowdown`` meanwhile): that part adds what it runs past the backward or slows it by, and
    the last bucket, final only as the backward ends, adds whole. ``hidden_s`` may be infinite."""
    return last_s + added_beside(sync_s - last_s, hidden_s, slowdown)


def update_s(layout, cluster, nbytes: int, dp_span: NodeSpan, stepped: int | None = None) -> float:
    """After its gradients are reduced, a rank's optimizer step over ``nbytes`` of parameters:
    whole, or under ZeRO-1 (with replicas) the share of its slowest replica, ``stepped`` bytes
    (`autopart.solve.replica_shares.slowest_replica_bytes`; a 1/dp share where not given: no
    replica steps less), and then the gather of the updated weights (bf16 under ``bf16``:
    ``autopart.predict.data_parallel.gathered_bytes``)."""
    if layout.dp == 1 or int(layout.zero) != 1:
        return cluster.optimizer_s_per_byte * nbytes
    share = nbytes / layout.dp if stepped is None else stepped
    return (cluster.optimizer_s_per_byte * share
            + cluster.all_gather_s(gathered_bytes(nbytes, layout.dtype), layout.dp, dp_span))


@functools.lru_cache(maxsize=1024)
def _placement(schedule: str, pp: int, chunks: int) -> tuple[int, ...]:
    return stage_placement(schedule, ranks=pp, chunks=chunks)


def hidden_s(layout, times: Sequence[float]) -> list[float]:
    """Per rank, the backward of its last microbatch through its stages (``times``: per stage, a
    microbatch's forward and backward): what its gradient all-reduce runs beside."""
    found = [0.0] * layout.pp
    for time, rank in zip(times, _placement(layout.schedule, layout.pp, layout.chunks)):
        found[rank] += (1 - FORWARD_SHARE) * time
    return found


def last_bucket_bytes(layout, costs, cuts: Sequence[int]) -> list[int]:
    """Per rank, the bytes of the parameters of the first block of its first stage (``costs``: a
    ``ChainCosts``; stage s ends after block ``cuts[s]``): the backward reaches them last, so the
    bucket that holds them is reduced after the rank's last backward."""
    found = [0] * layout.pp
    seen: set[int] = set()
    firsts = (0, *(c + 1 for c in cuts))
    for stage, rank in enumerate(_placement(layout.schedule, layout.pp, layout.chunks)):
        if rank not in seen:
            seen.add(rank)
            found[rank] = sum(costs.parameter_bytes[p] for p in costs.block_parameters[firsts[stage]]
                              if p not in costs.frozen_parameters)  # no gradient to reduce
    return found


def fully_sharded_extra_s(level: int, cluster, stage_bytes: float, forward_s: float, *, dp: int,
                          dp_span: NodeSpan, dtype: str, backward_s: float | None = None,
                          layers: tuple[int, int] = (0, 0), trained: float = 1.0) -> tuple[float, float]:
    """What FSDP adds to each forward and each backward of a stage holding ``stage_bytes`` of
    fp32 parameters in precision ``dtype`` (``autopart.predict.data_parallel.data_parallel_comm``'s
    levels 2 and 3). ``layers`` (level 3): the bytes and the number of its repeated layers
    (``stage_layers``), each its own unit, of equal size and compute, whose collectives run beside
    the compute (``autopart.predict.fully_sharded``); ``backward_s`` defaults to twice the forward.
    ``trained``: the share of the bytes that trains, all that is reduce-scattered."""
    if level not in FSDP_LEVELS or dp == 1:
        return 0.0, 0.0
    overlapped = cluster.reduction_overlaps
    if level == 2:
        scatter = _reduce_scatter_s(cluster, stage_bytes * trained, dp, dp_span)  # beside the next forward, as predicted
        return 0.0, added_beside(scatter, forward_s, cluster.overlap_slowdown) if overlapped else scatter
    return _layered_extra_s(cluster, stage_bytes, forward_s, 2 * forward_s if backward_s is None else backward_s,
                            layers, dp, dp_span, dtype, trained)[:2]


def layered_pending_s(cluster, stage_bytes: float, forward_s: float, *, dp: int, dp_span: NodeSpan, dtype: str,
                      backward_s: float | None = None, layers: tuple[int, int] = (0, 0), trained: float = 1.0) -> float:
    """Of a ZeRO-3 stage (as `fully_sharded_extra_s` takes it), the reduce-scatters still running
    as its backward ends, which the step waits for (``autopart.predict.fully_sharded``'s
    ``pending_s``, the compiled plan's tail): the root unit's, after the layers' that ran beside
    the backward, not the whole stage's."""
    if dp == 1:
        return 0.0
    return _layered_extra_s(cluster, stage_bytes, forward_s, 2 * forward_s if backward_s is None else backward_s,
                            layers, dp, dp_span, dtype, trained)[2]


@functools.lru_cache(maxsize=1 << 16)
def _layered_extra_s(cluster, stage_bytes: float, forward_s: float, backward_s: float, layers: tuple[int, int],
                     dp: int, dp_span: NodeSpan, dtype: str, trained: float) -> tuple[float, float, float]:
    """``fully_sharded_extra_s`` at level 3, and `layered_pending_s`, kept: refining a layout's
    cuts asks for the same stages again and again."""
    layered_bytes, count = layers
    pieces = (Piece(forward_s / count, backward_s / count, layered_bytes / count, count) if count
              else Piece(forward_s, backward_s),)
    cost = fully_sharded_cost(pieces, max(0.0, stage_bytes - (layered_bytes if count else 0)),
                              gather_s=lambda n: _gather_s(cluster, n, dp, dp_span, dtype),
                              reduce_s=lambda n: _reduce_scatter_s(cluster, n * trained, dp, dp_span),
                              overlapped=cluster.reduction_overlaps, slowdown=cluster.overlap_slowdown)
    return cost.forward_s, cost.backward_beside(forward_s), cost.pending_s


def _gather_s(cluster, parameter_bytes: float, dp: int, dp_span: NodeSpan, dtype: str) -> float:
    """FSDP's all-gather of a unit of ``parameter_bytes`` fp32 parameters (moved in the compute dtype)."""
    return cluster.all_gather_s(gathered_bytes(parameter_bytes, dtype), dp, dp_span)


def fully_sharded_floor_s(layout, costs, cluster) -> float:
    """Under FSDP (ZeRO-2 and 3), a pipeline (``estimate_step_s``'s, of gpipe, 1f1b or
    interleaved: at least ``m`` times a rank's stages, and the first two at least their stages'
    sum ``1 + (m - 1) / S`` times) that no cuts make shorter, counting only the collectives that
    every microbatch waits for (``costs``: the layout's ``ChainCosts``). A collective is taken to
    take no less time on more bytes; nothing else of its curve. 0 where this says nothing.

    ZeRO-2 reduce-scatters each stage's gradients (its rank's parameters over its chunks) after
    every backward, hidden behind a forward at most: each stage at least that long, and the
    busiest rank holds at least an even share of the parameters.

    ZeRO-3's stage waits in its forward for all of its layer units' gathers, and in its backward
    for them again (``autopart.predict.fully_sharded``: they take the data-parallel links one after
    another, each unit computes once its own is in, and each unit's reduce-scatter follows its
    backward on the same links): with ``G`` the gathers' sum and ``R`` the reduce-scatters', its
    forward and backward last at least ``stage_s(G, R)`` however long its compute (the last
    reduce-scatters may run beside the next forward's compute, a third of it). That least is
    convex in ``(G, R)`` and grows in proportion to them, so the stages' summed is at least that of
    their sums. A stage of ``L`` layer bytes has ``k = round(L / l)`` units of ``L / k`` bytes each
    (``stage_layers``, ``l`` the largest layer), each between half a layer and one and a half,
    so ``G`` and ``R`` are at least ``L`` times the least seconds per byte of a collective in that
    range; the stages of no unit hold half a layer each at most. The fullest stage has at least
    the ``units`` an even share rounds to, each at least ``1 - 0.5 / units`` of a layer. The root
    units' collectives (embeddings, norms, a layer a cut splits) are left out, and the estimate
    is the one given the layout's ``costs`` (its layer units; ``estimate_step_s`` always is)."""
    level = int(layout.zero)
    if level not in FSDP_LEVELS or layout.dp == 1 or layout.schedule not in _ONE_BACKWARD:
        return 0.0
    dp_span = layout.data_parallel_span(cluster.gpus_per_node)
    if level == 2:
        share = sum(costs.parameter_bytes.values()) // layout.pp / layout.chunks  # a stage's of the busiest rank
        scattered = share * costs.trained_share
        return layout.microbatches * layout.chunks * _reduce_scatter_s(cluster, scattered, layout.dp, dp_span) * (1 - 1e-9)
    if not costs.layer_bytes:
        return 0.0
    m, stages, layer = layout.microbatches, layout.stages, costs.layer_bytes
    layered = costs.prefix("owned_layer_bytes")[-1]

    def stage_s(gathers: float, reduces: float) -> float:
        """A stage's least forward and backward, whatever its compute ``t``: the forward ends after
        its third of ``t`` and the gathers, the backward after its two thirds and the gathers, and
        the links' work (``gathers + reduces``) after the forward's third; in ``t`` the sum of these
        maxima is convex and piecewise linear, least at one of its breakpoints."""
        def at(t: float) -> float:
            return (max(FORWARD_SHARE * t, gathers)
                    + max((1 - FORWARD_SHARE) * t, gathers, gathers + reduces - FORWARD_SHARE * t))
        g, r = gathers, reduces
        if not cluster.reduction_overlaps:  # each collective adds whole, and the compute on top
            return 2 * g + r
        return min(at(t) for t in (0.0, g / FORWARD_SHARE, g / (1 - FORWARD_SHARE), g + r, r / FORWARD_SHARE))

    # a stage reduce-scatters its layers' share of its trained bytes: none at least, where anything is frozen
    layered_trained = 0.0 if costs.frozen_parameters else 1.0
    units = round(-(-layered // stages) / layer)  # the fullest stage's bytes at least its ceiled share
    fullest = 0.0
    if units:
        unit = layer * (1 - 0.5 / units) * (1 - 1e-9)  # under the estimate's own, for its rounding
        fullest = stage_s(units * _gather_s(cluster, unit, layout.dp, dp_span, layout.dtype),
                          units * _reduce_scatter_s(cluster, unit * layered_trained, layout.dp, dp_span))
    held = max(0.0, layered - stages * layer / 2)  # in stages of a unit or more
    summed = stage_s(held * _least_per_byte(cluster, layer, layout.dp, dp_span, layout.dtype, gather=True),
                     held * _least_per_byte(cluster, layer, layout.dp, dp_span, layout.dtype, gather=False,
                                            trained=layered_trained))
    spread = m / layout.pp if layout.schedule == "interleaved" else 1 + (m - 1) / stages
    return max(m * fullest, spread * summed) * (1 - 1e-9)  # under the estimate's own rounding


@functools.lru_cache(maxsize=1024)
def _least_per_byte(cluster, layer: int, dp: int, dp_span: NodeSpan, dtype: str, *, gather: bool, pieces: int = 64,
                    trained: float = 1.0) -> float:
    """No gather (or reduce-scatter) of a unit between half of ``layer`` and one and a half takes
    fewer seconds per byte: over each of ``pieces`` spans of that range, its least bytes' over its most
    (a reduce-scatter moving the ``trained`` share of them)."""
    edges = [layer * (0.5 + k / pieces) for k in range(pieces + 1)]
    edges[0], edges[-1] = edges[0] * (1 - 1e-9), edges[-1] * (1 + 1e-9)  # the estimate's units, rounded

    def seconds(nbytes: float) -> float:
        if gather:
            return _gather_s(cluster, nbytes, dp, dp_span, dtype)
        return _reduce_scatter_s(cluster, nbytes * trained, dp, dp_span)

    return min(seconds(low) / high for low, high in zip(edges, edges[1:]))


_ONE_BACKWARD = ("gpipe", "1f1b", "interleaved")  # pipelines at least m times their slowest stage's F and B


def stage_layers(costs, cuts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per stage of ``cuts`` (``costs``: a ``ChainCosts``), the bytes of the repeated layers' own
    parameters it holds and how many layers (of ``costs.layer_bytes`` each) they make: the
    stage's ZeRO-3 layer units, taken as equal."""
    prefix = costs.prefix("owned_layer_bytes")
    found = []
    for first, end in zip((0, *(c + 1 for c in cuts)), (*(c + 1 for c in cuts), len(costs))):
        nbytes = prefix[end] - prefix[first]
        found.append((nbytes, round(nbytes / costs.layer_bytes) if costs.layer_bytes else 0))
    return tuple(found)


def stage_times(layout, cluster, times: Sequence[float], rank_parameter_bytes: Sequence[int],
                dp_span: NodeSpan, layers: Sequence[tuple[int, int]] | None = None,
                trained_bytes: Sequence[float] | None = None) -> tuple[float, ...]:
    """``times`` (per stage, a microbatch's forward and backward) with FSDP's gathers and
    unhidden reduce-scatters added; each stage holds its rank's parameters over its chunks, and
    at level 3 its ``layers`` (``stage_layers``; None: the stage is one unit); it reduce-scatters
    the share of them that trains (``trained_bytes``, per rank, as `tail_s` takes it)."""
    if int(layout.zero) not in FSDP_LEVELS or layout.dp == 1:
        return tuple(times)
    found = []
    for time, (share, forward_s, kwargs) in zip(times, _stages(layout, times, rank_parameter_bytes, layers,
                                                               trained_bytes)):
        forward, backward = fully_sharded_extra_s(int(layout.zero), cluster, share, forward_s, dp=layout.dp,
                                                  dp_span=dp_span, dtype=layout.dtype, **kwargs)
        found.append(time + forward + backward)
    return tuple(found)


def ranks_pending_s(layout, cluster, times: Sequence[float], rank_parameter_bytes: Sequence[int], dp_span: NodeSpan,
                    layers: Sequence[tuple[int, int]] | None,
                    trained_bytes: Sequence[float] | None = None) -> list[float] | None:
    """Per rank, what its ZeRO-3 reduce-scatters run past its last backward (`layered_pending_s`
    of its stages, as `stage_times` takes them; the longest, as the rank's stages' backwards end
    close together at the pipeline's end): `tail_s`'s ``pending_s``. None at other levels."""
    if int(layout.zero) != 3 or layout.dp == 1:
        return None
    found = [0.0] * layout.pp
    placement = _placement(layout.schedule, layout.pp, layout.chunks)
    for rank, (share, forward_s, kwargs) in zip(placement, _stages(layout, times, rank_parameter_bytes, layers,
                                                                  trained_bytes)):
        pending = layered_pending_s(cluster, share, forward_s, dp=layout.dp, dp_span=dp_span, dtype=layout.dtype, **kwargs)
        found[rank] = max(found[rank], pending)
    return found


def _stages(layout, times: Sequence[float], rank_parameter_bytes: Sequence[int],
            layers: Sequence[tuple[int, int]] | None, trained_bytes: Sequence[float] | None):
    """Per stage, its parameter bytes, its forward and the rest of `fully_sharded_extra_s`'s
    arguments, as `stage_times` and `ranks_pending_s` take them."""
    for stage, (time, rank) in enumerate(zip(times, _placement(layout.schedule, layout.pp, layout.chunks))):
        share = rank_parameter_bytes[rank] / layout.chunks
        trained = 1.0 if trained_bytes is None or not share else trained_bytes[rank] / layout.chunks / share
        yield share, FORWARD_SHARE * time, dict(backward_s=(1 - FORWARD_SHARE) * time, trained=trained,
                                                layers=layers[stage] if layers is not None else (0, 0))


def most_hidden_s(layout, costs, cluster) -> float:
    """More than any rank's ``hidden_s`` under any cuts (for the search's lower bound): no rank's
    last backward is longer than the whole chain's, fully recomputed, with a transfer at each end
    of each of its stages."""
    largest_transfer = max(boundary_transfer_s(costs, layout, cluster), default=0.0)
    return (1 - FORWARD_SHARE) * (costs.prefix("compute_s")[-1] + costs.prefix("forward_s")[-1]
                                  + 2 * layout.chunks * largest_transfer)


def fsdp_may_pay(scored, table, cluster) -> bool:
    """Whether ZeRO-2 might beat ZeRO-1's ``scored`` layout: only where on some rank the
    all-reduce adds more to the step (`exposed_all_reduce_s`), with what ZeRO-1's slowest replica
    steps beyond an even share (`update_s`: ZeRO-2 shards every tensor evenly), than a
    reduce-scatter of its gradients. On the same cuts ZeRO-2 adds at least that reduce-scatter to
    the tail (its last one, or one per microbatch where nothing hides them) and never less to a
    stage, and no cuts fit at ZeRO-2 that do not fit at ZeRO-1 (``autopart.predict.memory``);
    other cuts are not compared."""
    layout, cut = scored.layout, scored.cut
    costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    placement = _placement(layout.schedule, layout.pp, layout.chunks)
    dp_span = layout.data_parallel_span(cluster.gpus_per_node)
    hidden = hidden_s(layout, cut.stage_time_s) if cluster.reduction_overlaps else [0.0] * layout.pp
    last = last_bucket_bytes(layout, costs, cut.cuts)
    stepped = slowest_replica_bytes(layout, costs)
    spans = rank_spans(cut.cuts, len(costs), placement)
    for rank, nbytes in enumerate(trained_bytes(costs, mine) for mine in spans):  # what has a gradient
        exposed = exposed_all_reduce_s(cluster.all_reduce_s(nbytes, layout.dp, dp_span),
                                       cluster.all_reduce_s(last[rank], layout.dp, dp_span), hidden[rank],
                                       cluster.overlap_slowdown)
        uneven = 0.0 if stepped is None else cluster.optimizer_s_per_byte * (stepped(spans[rank]) - nbytes / layout.dp)
        if exposed + uneven > _reduce_scatter_s(cluster, nbytes, layout.dp, dp_span):
            return True
    return False
