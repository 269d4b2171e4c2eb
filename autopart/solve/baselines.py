"""Baselines that autopart's search is measured against, on the same costs and the same step.

Partitioners cut a chain of blocks into a given number of stages, reading only ``ChainCosts``
and, per block, the repeated layer it belongs to (``block_layers``):

- ``uniform_cuts``: DeepSpeed's ``partition_method="uniform"``: equal numbers of layer specs per
  stage, where each repeated layer is one and so is each run of blocks outside them (the
  embedding, the head), as DeepSpeed counts its ``EmbeddingPipe`` and head specs.
- ``equal_layer_cuts`` (``uniform_layer_cuts``): Megatron-LM's split, and what most users do by
  hand with torch.distributed.pipelining: equal numbers of repeated layers per stage, the
  embedding on the first stage and the head on the last.
- ``parameter_balanced_cuts``: DeepSpeed's ``partition_method="parameters"``: the same units as
  ``uniform_cuts``, the largest stage's parameter count as small as it can be
  (``ds_utils.partition_balanced``).
- ``pipedream_cuts``: PipeDream's dynamic program (Narayanan et al., "PipeDream: Generalized
  Pipeline Parallelism for DNN Training", SOSP'19, §3.1) for a straight pipeline:
  ``A(j, k) = min_i max(A(i, k-1), 2 C_i, T(i+1..j))``, the slowest stage (compute, or the
  activation and gradient transfer at its input) as small as it can be, memory not considered.

Whole-plan baselines, scored by ``autopart.solve.search.score_layout`` (the step estimate that
autopart ranks its layouts by) and found in ``autopart.solve.baseline_search``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from autopart.passes.blocks import BlockChain
from autopart.ir.errors import ConfigError
from autopart.solve.chain_costs import ChainCosts

__all__ = [
    "layer_of",
    "block_layers",
    "layer_units",
    "uniform_cuts",
    "equal_layer_cuts",
    "uniform_layer_cuts",
    "parameter_balanced_cuts",
    "pipedream_cuts",
    "stage_parameter_bytes",
]

_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")

Layers = Sequence[str | None]
"""Per block, the repeated layer it belongs to (``h.3``), or None outside them."""


def layer_of(module_path: str) -> str | None:
    """The repeated layer (``h.3``, ``layers.0``) that a module path lies in, or None outside them."""
    found = _LAYER.match(module_path)
    return found.group(1) if found else None


def block_layers(chain: BlockChain) -> list[str | None]:
    """Per block, the repeated layer it belongs to (``h.3``, ``layers.0``), or None outside them."""
    layers: list[str | None] = []
    for block in chain.blocks:
        found = [layer for n in block.nodes if (layer := layer_of(chain.op_graph.nodes[n].module_path))]
        layers.append(found[0] if found else None)
    return layers


def layer_units(layers: Layers) -> list[tuple[int, int]]:
    """(first, last) block of each unit: each repeated layer, and each run of blocks outside them."""
    units: list[tuple[int, int]] = []
    for k, layer in enumerate(layers):
        if units and layers[units[-1][0]] == layer:
            units[-1] = (units[-1][0], k)
        else:
            units.append((k, k))
    return units


def _unit_cuts(units: list[tuple[int, int]], sizes: Sequence[int]) -> tuple[int, ...]:
    """Cuts after the last block of each group of ``sizes[s]`` consecutive units."""
    cuts, taken = [], 0
    for size in sizes[:-1]:
        taken += size
        cuts.append(units[taken - 1][1])
    return tuple(cuts)


def uniform_cuts(layers: Layers, stages: int) -> tuple[int, ...]:
    """DeepSpeed's ``uniform``: ``ds_utils.partition_uniform`` over the units (the first stages
    take one more where they do not divide evenly)."""
    units = layer_units(layers)
    if len(units) < stages:
        raise ConfigError(f"the model has {len(units)} layers and other units, fewer than {stages} stages")
    base, extra = divmod(len(units), stages)
    return _unit_cuts(units, [base + (1 if s < extra else 0) for s in range(stages)])


def equal_layer_cuts(layers: Layers, stages: int) -> tuple[int, ...]:
    """Megatron's split: stage s ends after repeated layer round((s + 1) L / stages)."""
    order = list(dict.fromkeys(layer for layer in layers if layer is not None))
    if len(order) < stages:
        raise ConfigError(f"the model has {len(order)} repeated layers, fewer than {stages} stages")
    last_block = {layer: k for k, layer in enumerate(layers) if layer is not None}
    return tuple(last_block[order[round(s * len(order) / stages) - 1]] for s in range(1, stages))


def uniform_layer_cuts(chain: BlockChain, stages: int) -> tuple[int, ...]:
    """``equal_layer_cuts`` of a captured chain."""
    return equal_layer_cuts(block_layers(chain), stages)


def stage_parameter_bytes(costs: ChainCosts, first: int, last: int) -> int:
    """Parameter bytes (one tensor-parallel rank's share) that blocks ``first..last`` read."""
    names = {p for k in range(first, last + 1) for p in costs.block_parameters[k]}
    return sum(costs.parameter_bytes[p] for p in names)


def parameter_balanced_cuts(costs: ChainCosts, layers: Layers, stages: int) -> tuple[int, ...]:
    """DeepSpeed's ``parameters``: units whose parameter bytes are split so that the largest
    stage is as small as it can be (a tied weight counts in each unit that reads it)."""
    units = layer_units(layers)
    if len(units) < stages:
        raise ConfigError(f"the model has {len(units)} layers and other units, fewer than {stages} stages")
    weights = [stage_parameter_bytes(costs, a, b) for a, b in units]

    def parts(bound: int) -> list[int] | None:
        """Units per stage, each stage as long as ``bound`` allows while leaving one unit for
        each later stage; None if ``stages`` stages cannot hold all units under ``bound``."""
        sizes, k = [], 0
        for s in range(stages):
            remaining = stages - s - 1
            load, size = 0, 0
            while k < len(units) - remaining and (size == 0 or load + weights[k] <= bound):
                if weights[k] > bound:
                    return None
                load, size, k = load + weights[k], size + 1, k + 1
            sizes.append(size)
        return sizes if k == len(units) else None

    lo, hi = max(weights), sum(weights)  # the smallest largest stage lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if parts(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    sizes = parts(lo)
    assert sizes is not None
    return _unit_cuts(units, sizes)


def pipedream_cuts(costs: ChainCosts, stages: int, *, transfer_s: Sequence[float], recompute: str = "none") -> tuple[int, ...]:
    """PipeDream's partitioner over blocks: the cuts whose slowest stage is smallest, where a
    stage costs its forward, backward and recompute time and a cut after block i costs
    ``2 * transfer_s[i]`` (activations forward, gradients back) as a stage of its own."""
    blocks = len(costs)
    if stages > blocks:
        raise ConfigError(f"the chain has {blocks} blocks, fewer than {stages} stages")
    compute = np.asarray(costs.prefix("compute_s"), dtype=float)
    if recompute == "selective":
        compute = compute + np.asarray(costs.prefix("selective_recompute_s"), dtype=float)
    elif recompute in ("full", "stage"):
        compute = compute + np.asarray(costs.prefix("full_recompute_s"), dtype=float)
    # time[i, j]: blocks i..j as one stage (inf where j < i)
    time = compute[None, 1:] - compute[:-1, None]
    time = np.where(np.triu(np.ones((blocks, blocks), dtype=bool)), time, np.inf)
    comm = 2 * np.asarray([*transfer_s, 0.0], dtype=float)  # comm[i]: the cut after block i
    best = time[0].copy()  # best[j]: blocks 0..j in k stages
    choice = np.zeros((stages, blocks), dtype=int)  # choice[k, j]: the first block of the last stage
    for k in range(1, stages):
        # candidates[i, j]: blocks 0..i in k stages, then i+1..j as stage k
        candidates = np.maximum(np.maximum(best[:-1, None], comm[:-1, None]), time[1:, :])
        first = np.argmin(candidates, axis=0)
        best = candidates[first, np.arange(blocks)]
        choice[k] = first + 1
    cuts, last = [], blocks - 1
    for k in range(stages - 1, 0, -1):
        first = int(choice[k, last])
        cuts.append(first - 1)
        last = first - 1
    return tuple(reversed(cuts))
