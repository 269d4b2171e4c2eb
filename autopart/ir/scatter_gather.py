"""Pipeline messages under tensor parallelism: each rank sends only its share.

A tensor that crosses a pipeline boundary replicated (every tensor-parallel rank holds the same
copy) would go as t identical messages over t links. Instead, each sender sends the 1/t of the
flattened tensor at its own tensor-parallel index, and each receiver gathers the t parts from its
group, over the links inside the node, which are much faster than the links between the nodes
that pipeline stages usually span (Narayanan et al., SC21, §4.1). A tensor whose element count t
does not divide travels whole.

A sequence-parallel value (the residual stream between Megatron-SP layers,
``TensorMeta.split_dim``) is held split already: each rank sends its own slice to its peer, and
the peer keeps it as the slice it computes on, as Megatron-SP does. Nothing is gathered, and the
gradient comes back the same way.

The runtime (`autopart.runtime.p2p`), the step-time model (`autopart.predict.messages`) and the
memory model read these rules.
"""

from __future__ import annotations

from autopart.ir.tensors import TensorMeta

__all__ = ["parts", "gathered", "held_bytes", "held_shape", "sent_bytes"]


def parts(numel: int, tp: int) -> int:
    """How many parts a replicated tensor of ``numel`` elements travels in between stages on ``tp`` ranks."""
    return tp if tp > 1 and numel > 0 and numel % tp == 0 else 1


def held_shape(meta: TensorMeta, tp: int) -> tuple[int, ...]:
    """The shape of the tensor one rank holds, sends and receives (its slice where ``meta`` is split)."""
    if meta.split_dim is None or tp == 1:
        return meta.shape
    d = meta.split_dim
    if meta.shape[d] % tp:
        raise ValueError(f"a tensor of shape {list(meta.shape)} cannot split {tp} ways along dim {d}")
    return (*meta.shape[:d], meta.shape[d] // tp, *meta.shape[d + 1:])


def held_bytes(meta: TensorMeta, tp: int) -> int:
    """Bytes of the tensor one rank holds: its slice where ``meta`` is split, else all of it."""
    return meta.nbytes // (tp if meta.split_dim is not None else 1)


def sent_bytes(meta: TensorMeta, tp: int) -> int:
    """Bytes one rank sends of ``meta``: its slice, its 1/t of a replicated tensor that splits, or all of it."""
    return meta.nbytes // (tp if meta.split_dim is not None else parts(meta.numel, tp))


def gathered(meta: TensorMeta, tp: int) -> bool:
    """Whether the receivers all-gather the parts of ``meta`` (a replicated tensor sent in parts)."""
    return meta.split_dim is None and parts(meta.numel, tp) > 1
