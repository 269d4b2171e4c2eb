"""Pipeline cuts pinned by the number of repeated layers on each stage (``--stage-layers``).

What a user of Megatron-LM (``--decoder-first-pipeline-num-layers``) or DeepSpeed
(``partition_method``) sets by hand: stage s holds the next ``counts[s]`` repeated layers, the
blocks before the first layer (the embedding) go with the first stage and those after the last
(the final norm, the head, the loss) with the last, as both frameworks place them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from autopart.ir.errors import ConfigError, InfeasibleError
from autopart.ir.plan import Plan
from autopart.passes.annotate import module_path
from autopart.passes.blocks import BlockChain
from autopart.solve.baselines import Layers, block_layers, layer_of
from autopart.solve.cut_problem import PipelineProblem

__all__ = ["check_captured_layers", "check_fits", "layer_count_cuts", "megatron_counts", "stage_layer_cuts"]


def layer_count_cuts(layers: Layers, counts: Sequence[int]) -> tuple[int, ...]:
    """Cuts after the last block of layer ``counts[0] + ... + counts[s] - 1`` for each stage s but the last."""
    order = list(dict.fromkeys(layer for layer in layers if layer is not None))
    _check_counts(order, counts, exact=True)
    last_block = {layer: k for k, layer in enumerate(layers) if layer is not None}
    cuts, taken = [], 0
    for count in counts[:-1]:
        taken += count
        cuts.append(last_block[order[taken - 1]])
    return tuple(cuts)


def check_captured_layers(graph: fx.Graph, counts: Sequence[int]) -> None:
    """Refuse, from the captured ``graph`` before it is costed, ``--stage-layers`` counts that no
    chain of its blocks can meet: a model with no repeated layers, or counts summing to more
    layers than its ops lie in. A block lies in the layer of its first op that lies in one, so the
    chain names no layer that the graph does not; `stage_layer_cuts` checks the rest."""
    order = list(dict.fromkeys(layer for node in graph.nodes if (layer := layer_of(module_path(node)))))
    _check_counts(order, counts, exact=False)


def _check_counts(order: list[str], counts: Sequence[int], *, exact: bool) -> None:
    if not order:
        raise ConfigError("--stage-layers counts repeated layers (a ModuleList of blocks), and this model has none; "
                          "drop --stage-layers")
    if sum(counts) > len(order) or (exact and sum(counts) != len(order)):
        raise ConfigError(
            f"--stage-layers sums to {sum(counts)} layers but the model has {len(order)} ({order[0]} to {order[-1]}); "
            f"give counts that sum to {len(order)}"
        )


def megatron_counts(layers: int, stages: int, *, first: int | None, last: int | None) -> tuple[int, ...]:
    """Megatron-LM's split: ``first`` layers on the first stage and ``last`` on the last (either
    may be None), the other stages an equal share of the rest, which must divide evenly."""
    middle = stages - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if rest < middle or (middle and rest % middle) or (not middle and rest):
        raise ConfigError(
            f"--first-stage-layers/--last-stage-layers leave {rest} of the model's {layers} layers for {middle} "
            f"other stage(s), which must each take an equal share of at least one; change the counts or use "
            "--stage-layers"
        )
    share = rest // middle if middle else 0
    counts = [share] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def stage_layer_cuts(chain: BlockChain, counts: Sequence[int] | None, *, stages: int, first: int | None = None,
                     last: int | None = None) -> tuple[int, ...]:
    """``layer_count_cuts`` of a captured chain, from every stage's count or from Megatron's form."""
    layers = block_layers(chain)
    if counts is None:
        counts = megatron_counts(len({layer for layer in layers if layer is not None}), stages, first=first, last=last)
    return layer_count_cuts(layers, counts)


def check_fits(plan: Plan, problem: PipelineProblem, *, pinned: bool = True) -> Plan:
    """``plan`` refused in one line when a rank's predicted memory breaks the limit: of pinned
    cuts (``pinned``), or of the solver's, whose problem holds each block's figures but not the
    inputs a recomputing stage keeps for its backward, nor, with a mode per stage, each stage's
    own recompute (the plan's memory holds both)."""
    memory = plan.predicted.memory_bytes
    rank = max(range(len(memory)), key=memory.__getitem__)
    if memory[rank] > problem.memory_limit_bytes:
        gib = 1 << 30
        needs = f"needs {memory[rank] / gib:.2f} GiB on pipeline rank {rank}, more than the {problem.memory_limit_bytes / gib:.2f} GiB limit"
        if pinned:
            raise InfeasibleError(f"the --stage-layers split {needs}; move layers off that rank's stages, recompute "
                                  "more, or drop --stage-layers to let the solver cut")
        modes = sorted({stage.recompute for stage in plan.stages if stage.recompute != "none"})
        kept = (f", with what --recompute {'/'.join(modes)} keeps and rebuilds for backward (its stages' inputs, and "
                "in backward the activations it runs again)" if modes else "")
        raise InfeasibleError(f"the plan {needs}{kept}; use more stages (--pp), more tensor parallelism (--tp) "
                              "or smaller microbatches (--micro-batch-size)")
    return plan
