"""Activation recompute: which tensors each mode keeps from forward to backward, and what it costs.

A stage runs in one of four modes (``StagePlan.recompute``):

- ``none``: autograd keeps every tensor that the backward reads (``NodeCost.saved_bytes``).
- ``selective``: the stage's forward runs under ``torch.utils.checkpoint`` with a policy that
  keeps the outputs of the compute-heavy ops (`keeps_output`: matrix products and attention)
  and recomputes everything else in backward. This is Megatron's selective recompute
  (Korthikanti et al., MLSys'23): the ops that are cheap to run again (norms, activations,
  softmax, dropout, casts) are the ones whose outputs take the memory.
- ``full``: with a whole backward, each repeated layer that the stage holds whole keeps only its
  inputs and runs again in backward, one layer at a time (Megatron-LM's full recompute of one
  layer per checkpoint); the rest of the stage keeps what ``none`` keeps. Under a split backward
  (zero-bubble), or in a stage without whole layers, it is ``stage``.
- ``stage``: only the stage's inputs are kept and its whole forward runs again in backward,
  which then holds every activation of the stage at once (`autopart.runtime.forward` says why a
  split backward always does so). Per microbatch in flight it keeps one input where ``full``
  keeps one per layer: the lighter of the two where a stage of few layers holds many
  microbatches (an early stage of a deep pipeline), never the faster.

`keeps_output` is the one definition of the selective policy: the runtime's checkpoint policy
(`autopart.runtime.forward`) and the annotate pass, which measures per node the bytes of the
outputs it keeps (``NodeCost.selective_saved_bytes``), both ask it about the same aten ops.

`recompute_cost(blocks, mode, input_bytes=..., layers=...)` gives the figures of one stage in one mode:
the bytes held per microbatch in flight, the forward seconds that the backward runs again, and
the bytes that exist only while one microbatch's backward runs (the recomputed activations).
The plan search calls it per candidate stage; `stage_input_bytes` gives its ``input_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopart.ir.errors import ConfigError
from autopart.ir.recompute import RECOMPUTE_MODES

if TYPE_CHECKING:
    from torch import fx

    from autopart.passes.annotate import OpGraph
    from autopart.passes.blocks import Block, BlockChain
    from autopart.schedule import Schedule

__all__ = ["RecomputeCost", "recompute_cost", "checkpointed_layers", "stage_input_bytes", "batch_inputs", "transient_microbatches",
           "stage_modes", "check_mode"]


@dataclass(frozen=True, kw_only=True)
class RecomputeCost:
    """One stage in one recompute mode, per microbatch (bytes on one rank, before tensor parallelism)."""

    mode: str
    saved_bytes: int
    """Held from the microbatch's forward until its backward: what the schedule multiplies by
    the microbatches in flight."""
    extra_backward_s: float
    """Forward work that the backward runs again (in the input-gradient half, I, when split)."""
    transient_bytes: int
    """Recomputed activations, held only while this microbatch's backward runs (from I to W in a
    zero-bubble schedule): added once to the stage's peak, not per microbatch in flight."""


def recompute_cost(blocks: Sequence[Block], mode: str, *, input_bytes: int,
                   layers: Sequence[tuple[range, int]] = ()) -> RecomputeCost:
    """The figures of a stage made of ``blocks`` that receives ``input_bytes`` per microbatch.

    ``input_bytes`` is what ``torch.utils.checkpoint`` keeps of the stage's arguments: the
    tensors it receives and the batch inputs it reads (`stage_input_bytes`). Selective keeps
    them and the outputs of the kept ops; its backward runs the other ops again and holds their
    outputs for a while. Stage (and full without ``layers``) keeps the inputs alone; its backward
    runs the whole forward again and holds, for a while, everything that ``none`` would have kept.

    ``layers`` (full recompute under a whole backward): the repeated layers checkpointed one by
    one, each as the positions of its blocks in ``blocks`` and the bytes of its inputs
    (`checkpointed_layers`). Each keeps its inputs, the blocks outside them what ``none`` keeps,
    and the backward rebuilds one layer at a time: the largest layer's activations.
    """
    check_mode(mode, "recompute mode")
    kept = sum(b.saved_bytes for b in blocks)
    if mode == "full" and layers:
        inside = {k for span, _ in layers for k in span}
        return RecomputeCost(
            mode=mode,
            saved_bytes=sum(b.saved_bytes for k, b in enumerate(blocks) if k not in inside)
            + sum(nbytes for _, nbytes in layers),
            extra_backward_s=sum(blocks[k].forward_s for k in inside),
            transient_bytes=max(sum(blocks[k].saved_bytes for k in span) for span, _ in layers),
        )
    if mode == "none":
        return RecomputeCost(mode=mode, saved_bytes=kept, extra_backward_s=0.0, transient_bytes=0)
    if mode == "selective":
        selective = sum(b.selective_saved_bytes for b in blocks)
        return RecomputeCost(
            mode=mode,
            saved_bytes=input_bytes + selective,
            extra_backward_s=sum(b.selective_recompute_s for b in blocks),
            transient_bytes=max(0, kept - selective),
        )
    return RecomputeCost(
        mode=mode, saved_bytes=input_bytes, extra_backward_s=sum(b.forward_s for b in blocks), transient_bytes=kept
    )


def checkpointed_layers(chain: BlockChain, first: int, last: int, spans: Iterable[tuple[int, int]],
                        entering: Sequence[int] | None = None) -> list[tuple[range, int]]:
    """The repeated layers (``spans``: each one's blocks, first and end, in ``chain``) that the stage
    of blocks ``first..last`` holds whole, as `recompute_cost`'s ``layers``: each one's blocks
    counted from ``first``, and the bytes of what enters it (the boundary before it; none for a
    layer that begins the model, which reads the batch alone), or ``entering[begin]`` where given
    (`autopart.passes.front.layer_input_bytes`: one tensor-parallel rank's share). A layer a cut
    splits is written inline in both stages (`autopart.codegen.layers`), so it is not
    checkpointed by itself."""
    if entering is None:
        entering = [0, *(b.nbytes for b in chain.boundaries)]
    return [(range(begin - first, end - first), entering[begin]) for begin, end in spans if first <= begin and end - 1 <= last]


def stage_input_bytes(chain: BlockChain, first: int, last: int, *, by_name: dict[str, fx.Node] | None = None,
                      held: Sequence[int] | None = None) -> int:
    """Bytes of one microbatch's arguments of the stage of blocks ``first..last``: the tensors that
    cross the boundary into it, and the graph inputs (token ids, targets) that its nodes read.
    ``by_name``: the graph's nodes by name (`batch_inputs`). ``held``: per boundary, the bytes one
    rank holds of what crosses it (`autopart.passes.front.boundary_held_bytes`); all of it by default."""
    received = (held[first - 1] if held is not None else chain.boundaries[first - 1].nbytes) if first > 0 else 0
    costs = chain.op_graph.nodes
    read = batch_inputs(chain.op_graph, (n for b in chain.blocks[first : last + 1] for n in b.nodes), by_name=by_name)
    return received + sum(costs[p].output.nbytes for p in read if costs[p].output is not None)


def batch_inputs(op_graph: OpGraph, nodes: Iterable[str], *, by_name: dict[str, fx.Node] | None = None) -> set[str]:
    """The graph inputs that ``nodes`` read through batch-derived nodes alone (a stage's token ids
    and targets, not the weights). ``by_name``: the graph's nodes by name, made once where a caller
    asks for every stage of a long chain (made here otherwise)."""
    by_name = by_name if by_name is not None else {n.name: n for n in op_graph.fx_nodes()}
    costs = op_graph.nodes
    found: set[str] = set()
    seen: set[str] = set()
    stack = [a for n in nodes for a in by_name[n].all_input_nodes]
    while stack:
        node = stack.pop()
        if node.name in seen or not costs[node.name].batch_derived or node.op == "get_attr":
            continue
        seen.add(node.name)
        if node.op == "placeholder":
            found.add(node.name)
        stack.extend(node.all_input_nodes)
    return found


def transient_microbatches(schedule: Schedule, stages: int) -> tuple[int, ...]:
    """Per stage, how many microbatches hold their recomputed activations at once.

    One (its backward) in a schedule with whole backwards. In a zero-bubble schedule the
    recomputed activations live from the microbatch's I to its W, and W may wait several
    microbatches: counted from the action lists themselves.
    """
    from autopart.schedule import Kind

    most = [1] * stages
    for actions in schedule.values():
        waiting: dict[int, int] = {}
        for action in actions:
            if action.kind is Kind.I:
                waiting[action.stage] = waiting.get(action.stage, 0) + 1
                most[action.stage] = max(most[action.stage], waiting[action.stage])
            elif action.kind is Kind.W:
                waiting[action.stage] -= 1
    return tuple(most)


def check_mode(mode: Any, what: str) -> str:
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"unknown {what} {mode!r}; use one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def stage_modes(recompute: str | Sequence[str], stages: int) -> tuple[str, ...]:
    """One mode per stage from a mode for every stage or a sequence of one per stage, checked."""
    if isinstance(recompute, str):
        return (check_mode(recompute, "--recompute mode"),) * stages
    modes = tuple(recompute)
    for mode in modes:
        check_mode(mode, "--recompute mode")
    if len(modes) != stages:
        raise ConfigError(
            f"--recompute lists {len(modes)} modes for {stages} stages; give one mode for all stages "
            f"or one per stage (pp x chunks = {stages}), e.g. --recompute {','.join(['full'] * stages)}"
        )
    return modes
