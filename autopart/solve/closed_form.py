"""A layout's step in closed form, as the search ranks thousands of them: the schedule's pipeline
latency over its stages' times (with FSDP's collectives), then what the data-parallel collectives
run past it and the busiest rank's optimizer step (``autopart.solve.data_parallel_tail``). The
finalists are simulated action by action instead (``autopart.solve.simulated``).

Functions of plain values: the layout, cut and cluster are read by attribute only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from autopart.schedule import stage_placement
from autopart.solve.chain_costs import ChainCosts
from autopart.solve.data_parallel_tail import hidden_s, ranks_pending_s, stage_layers, stage_times, tail_s
from autopart.solve.interleaved import interleaved_pipeline_s
from autopart.solve.replica_shares import rank_spans, trained_bytes
from autopart.solve.vshape import zbv_pipeline_s
from cost_models.comm import NodeSpan

__all__ = ["estimate_step_s"]


def estimate_step_s(layout, cut, cluster, rank_parameter_bytes: list[int], dp_span: NodeSpan, last_bytes: list[int] | None,
                    costs: ChainCosts, stepped: Callable[[tuple[tuple[int, int], ...]], int] | None = None) -> float:
    """The step of ``layout`` cut as ``cut`` (a `StageCut`) says. ``costs``: the chain's, whose
    repeated layers are ZeRO-3's units (``layout_bound`` counts their gathers). ``stepped``: of a
    rank's spans, what its slowest ZeRO-1 replica steps
    (`autopart.solve.replica_shares.slowest_replica_bytes`; None: a 1/dp share)."""
    m, p = layout.microbatches, layout.pp
    layers = stage_layers(costs, cut.cuts) if int(layout.zero) == 3 and layout.dp > 1 else None
    spans = _rank_spans(cut.cuts, len(costs), layout.schedule, p, layout.chunks)
    # what each rank reduces and steps: no frozen parameter's bytes
    trained = [trained_bytes(costs, mine) for mine in spans] if costs.frozen_parameters else None
    times = stage_times(layout, cluster, cut.stage_time_s, rank_parameter_bytes, dp_span, layers, trained)
    if layout.schedule == "interleaved":
        pipeline = interleaved_pipeline_s(times, p, m, layout.chunks)
    elif layout.schedule == "zbv":
        pipeline = zbv_pipeline_s(times, cut.stage_weight_s, p, m)
    else:
        pipeline = sum(times) + (m - 1) * max(times)
        if layout.schedule == "zb-h1":  # W fills the cool-down bubble: (p-1)(F+I-W), not (p-1)(F+I+W)
            pipeline -= 2 * (p - 1) * min(cut.stage_weight_s)
    stepped_bytes = None if stepped is None else [stepped(mine) for mine in spans]
    return pipeline + tail_s(layout, cluster, rank_parameter_bytes, dp_span, hidden_s(layout, times), last_bytes,
                             stepped_bytes, trained,
                             ranks_pending_s(layout, cluster, cut.stage_time_s, rank_parameter_bytes, dp_span, layers,
                                             trained))


@functools.lru_cache(maxsize=256)
def _rank_spans(cuts: tuple[int, ...], blocks: int, schedule: str, pp: int,
                chunks: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """`rank_spans` of a layout's cuts, kept: refining a layout judges cuts again and again, the
    ones it moves from most (a few hundred: an entry of a deep pipeline holds thousands of spans)."""
    return tuple(rank_spans(cuts, blocks, stage_placement(schedule, ranks=pp, chunks=chunks)))
