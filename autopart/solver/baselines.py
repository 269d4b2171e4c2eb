"""Hand-placement baselines that autopart's cuts are measured against, on the same costs.

``uniform_layer_cuts``: DeepSpeed's ``partition_method="uniform"``, what most users do by hand
with torch.distributed.pipelining: equal numbers of repeated layers per stage, the embedding on
the first stage and the head on the last.
"""

from __future__ import annotations

import re

from autopart.blocks import BlockChain
from autopart.errors import ConfigError

__all__ = ["block_layers", "uniform_layer_cuts"]

_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_layers(chain: BlockChain) -> list[str | None]:
    """Per block, the repeated layer it belongs to (``h.3``, ``layers.0``), or None outside them."""
    layers: list[str | None] = []
    for block in chain.blocks:
        paths = [chain.op_graph.nodes[n].module_path for n in block.nodes]
        found = [m.group(1) for p in paths if (m := _LAYER.match(p))]
        layers.append(found[0] if found else None)
    return layers


def uniform_layer_cuts(chain: BlockChain, stages: int) -> tuple[int, ...]:
    layers = block_layers(chain)
    order = list(dict.fromkeys(layer for layer in layers if layer is not None))
    if len(order) < stages:
        raise ConfigError(f"the model has {len(order)} repeated layers, fewer than {stages} stages")
    last_block = {layer: k for k, layer in enumerate(layers) if layer is not None}
    cuts = []
    for s in range(1, stages):
        boundary_layer = order[round(s * len(order) / stages) - 1]
        cuts.append(last_block[boundary_layer])
    return tuple(cuts)
