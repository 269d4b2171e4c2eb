"""Choose the tensor-parallel strategy of every op of a block with CP-SAT.

``shard_chain(chain, tp=t, cost_model=...)`` gives one ``BlockSharding`` per block: a strategy
per op (``autopart.solve.sharding``) and a placement per parameter, minimising the block's
compute (divided by t where the op is split) plus the collectives that the choices imply:

- R -> S(d): a local slice forward, an all-gather of the gradient backward;
- S(d) -> R: an all-gather forward;
- P -> R: an all-reduce forward;
- P -> S(d): a reduce-scatter forward, an all-gather backward (with sequence parallelism only);
- S(d) -> R read by a split op: an all-gather forward, a reduce-scatter of its partial gradient
  backward (Megatron-SP's ``g``);
- a replicated tensor that needs a gradient, consumed by a split op, gets a partial gradient:
  one all-reduce backward (Megatron's ``f``);
- any other change of placement is not allowed.

Time first, then weights, (with sequence parallelism, then activations,) then collectives: among the layouts within ``TIME_TOLERANCE`` of the
fastest, those within it of the fewest parameter bytes per rank, and of those the one whose
collectives take least time (the collectives' figures, their overlap and contention, are the less
certain part of the estimate; among layouts this close, Megatron's has the fewest). Where
kernels are launch-bound (small widths, a 16-bit matmul rate) splitting an op saves almost no
time, and a time-only objective would flip between the replicated and the Megatron layout on
rounding while the replicated one holds t times the weights on every rank.

What crosses a block boundary is replicated, or with sequence parallelism split over the sequence
(``autopart.solve.sequence``; a block's partial or sharded output is converted as it leaves, at
that collective's cost), so blocks are solved independently, and identical
blocks (the repeated layers) are solved once. A parameter read by two blocks (tied embeddings)
gets one placement: each candidate is tried with both blocks pinned, and the cheapest kept.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from autopart.solve._cp_sat import cp_model
from torch import fx

from autopart.passes.blocks import Block, BlockChain
from autopart.solve.overlap import fused_seconds, gathered_input, moved_share, moves_for_products
from autopart.solve.seed_shares import local_seed_bytes
from autopart.solve.sequence import SEQUENCE_DIM, boundary_placement
from autopart.solve.sharding import REPLICATE, Placement, Strategy, is_tuple_of_tensors, shard
from autopart.solve.sharding_rules import strategies
from cost_models import CostModel
from cost_models.calibration import usable_cores

__all__ = ["BlockSharding", "conversion", "divided_seconds", "fastest_compute_s", "gathers_for_split_op", "listed_strategies",
           "shard_chain"]

_NS = 1e9
_SOLVERS = min(8, usable_cores())
"""Block models solved at once: CP-SAT solves on one worker each (``_BlockModel.solve``)."""
TIME_TOLERANCE = 0.05
"""How far (a fraction) from the fastest a layout may be and still win on memory, and from the
fewest bytes and still count as that small: within what the roofline can resolve (its launch
overheads are estimates, and its error against published runs is larger than this)."""


@dataclass(frozen=True, kw_only=True)
class BlockSharding:
    strategies: dict[str, Strategy]  # tensor-producing compute node -> its strategy
    parameters: dict[str, Placement]  # parameter target -> placement
    compute_s: float  # forward + backward of one microbatch on one rank
    communication_s: float
    saved_bytes: int  # saved for backward on one rank
    weight_seed_bytes: int = 0  # what a split backward keeps from I to W on one rank (`autopart.passes.weight_seeds`)
    sequence_parallel: bool = False  # boundaries split over the sequence (``autopart.solve.sequence``)
    overlapped: dict[str, int] = field(default_factory=dict)  # linear -> the pieces it runs in (``--tp-overlap``)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.communication_s


def conversion(
    source: Placement, target: Placement, *, sequence_parallel: bool = False
) -> tuple[str | None, str | None] | None:
    """(forward collective, backward collective) to turn ``source`` into ``target``; None if not
    allowed. The reduce-scatter (P -> S) only with ``sequence_parallel``: without it the layouts
    stay the ones the all-reduce gives, which cost the same."""
    if source == target:
        return None, None
    if source == REPLICATE and target.kind == "S":
        return None, "all_gather"
    if source.kind == "S" and target == REPLICATE:
        return "all_gather", None
    if source.kind == "P" and target == REPLICATE:
        return "all_reduce", None
    if sequence_parallel and source.kind == "P" and target.kind == "S" and target.groups == 1:
        return "reduce_scatter", "all_gather"
    return None


def gathers_for_split_op(source: Placement, target: Placement, copy: bool) -> bool:
    """Whether an S(d) -> R conversion whose result a split op reads (``copy``) is one
    all-gather whose backward reduce-scatters, instead of an all-gather and an all-reduce of the
    gradient (``autopart.runtime.collectives.gather_from_sequence``)."""
    return copy and source.kind == "S" and source.groups == 1 and target == REPLICATE


class _BlockModel:
    def __init__(
        self, chain: BlockChain, block: Block, t: int, cost_model: CostModel, pinned: dict[str, Placement], nodes: int,
        sequence_parallel: bool = False, overlap: bool = False, fewest: int | None = None,
    ):
        self.chain, self.block, self.t, self.cost_model = chain, block, t, cost_model
        self.sequence_parallel, self.overlap = sequence_parallel, overlap
        self.nodes, self.fewest = nodes, fewest
        op_graph = chain.op_graph
        fx_nodes = {n.name: n for n in op_graph.fx_nodes()}
        self.members = [fx_nodes[n] for n in block.nodes if self._tensorish(fx_nodes[n])]
        self.options = {n.name: strategies(n, op_graph, t) for n in self.members}
        self.model = cp_model.CpModel()
        m = self.model
        self.choice = {
            n.name: [m.new_bool_var(f"{n.name}_strategy{i}") for i in range(len(self.options[n.name]))]
            for n in self.members
        }
        for bools in self.choice.values():
            m.add_exactly_one(bools)
        # placements of what the members read: members (from their strategy), parameters (free choice)
        self.placed: dict[str, dict[Placement, cp_model.IntVar]] = {}
        for n in self.members:
            by_output: dict[Placement, list] = {}
            for i, s in enumerate(self.options[n.name]):
                by_output.setdefault(s.output, []).append(self.choice[n.name][i])
            self.placed[n.name] = {}
            for placement, bools in by_output.items():
                var = m.new_bool_var(f"{n.name}_is_{placement}")
                m.add(var == sum(bools))
                self.placed[n.name][placement] = var
        self.parameters = [p for p in dict.fromkeys(self._parameter_inputs())]
        for name in self.parameters:
            wanted = {REPLICATE}
            for n in self.members:
                j = n.all_input_nodes.index(fx_nodes[name]) if fx_nodes[name] in n.all_input_nodes else None
                if j is not None:
                    wanted |= {s.inputs[j] for s in self.options[n.name] if s.inputs[j] is not None}
            wanted = {p for p in wanted if p.kind != "P"}  # a parameter is replicated or sharded, never partial
            target = str(fx_nodes[name].target)
            if target in pinned:
                wanted = {pinned[target]}
            bools = {p: m.new_bool_var(f"{name}_is_{p}") for p in sorted(wanted)}
            m.add_exactly_one(bools.values())
            self.placed[name] = bools
        self.objective = []  # seconds: compute and collectives
        self.communication = []  # seconds: the collectives alone
        self.needs: dict[tuple[str, Placement, bool], list] = {}  # (value, placement, copied) -> who needs it
        self.readers: dict[tuple[str, Placement, bool], list[fx.Node]] = {}  # the same -> the ops that may read it
        self.fx_nodes = fx_nodes
        self.memory = [  # parameter bytes per rank: what tensor parallelism is there to divide
            op_graph.nodes[name].parameter_bytes // (t if p.kind == "S" else 1) * placed
            for name in self.parameters for p, placed in self.placed[name].items()
        ]  # fmt: skip
        for n in self.members:
            self._edges(n)
        in_block = set(block.nodes)  # a size read inside the block folds to a number: it does not leave
        for n in self.members:  # what leaves the block leaves replicated: reduced or gathered on its way out
            if any(u.name not in in_block for u in n.users):
                self._leaves(n)
        self._convert()
        m.minimize(sum(self.objective))

    def _activations(self) -> list:
        """Bytes saved for backward per rank: sequence parallelism's gain is here, not in time
        (its collectives cost what the all-reduces do), so with it this ranks the layouts after the
        weights, before the collectives: the norms and residuals split over the sequence."""
        saved = self.chain.op_graph.nodes
        return [
            saved[n.name].saved_bytes // (self.t if strategy.divided else 1) * self.choice[n.name][i]
            for n in self.members for i, strategy in enumerate(self.options[n.name]) if saved[n.name].saved_bytes
        ]  # fmt: skip

    def _local_saved_bytes(self, node: fx.Node, strategy: Strategy, chosen: dict[str, Strategy]) -> int:
        """What the op saves for backward on one rank: a t-th where it is split, except the inputs
        it reads whole (a column-parallel linear keeps its whole input), unless that input is
        gathered from a sequence split for that linear alone (``gathered_linear`` keeps the
        slice; ``autopart.solve.overlap.gathered_input`` says when)."""
        costs = self.chain.op_graph.nodes
        saved = costs[node.name].saved_bytes
        if not strategy.divided:
            return saved
        whole = 0
        for arg, required in zip(node.all_input_nodes, strategy.inputs):
            cost = costs.get(arg.name)
            if required != REPLICATE or cost is None or cost.output is None or not cost.needs_grad or cost.is_parameter:
                continue
            source = chosen[arg.name].output if arg.name in chosen else self._boundary(arg.name)
            regathered = gathered_input(self.chain.op_graph, node, chosen) is arg
            if not (regathered and source == shard(SEQUENCE_DIM)):
                whole += cost.output.nbytes
        whole = min(whole, saved)
        return whole + (saved - whole) // self.t

    def _tensorish(self, node: fx.Node) -> bool:
        return self.chain.op_graph.nodes[node.name].output is not None or is_tuple_of_tensors(node, self.chain.op_graph)

    def divided_seconds(self, name: str) -> float:
        return divided_seconds(self.chain.op_graph, name, self.t, self.cost_model)

    def _parameter_inputs(self):
        for n in self.members:
            for arg in n.all_input_nodes:
                if self.chain.op_graph.nodes[arg.name].is_parameter:
                    yield arg.name

    def _seconds(self, kind: str | None, name: str, share: float = 1.0) -> float:
        """One collective of ``name``'s bytes (a ``share`` of them: one piece of an overlapped one)."""
        if kind is None:
            return 0.0
        meta = self.chain.op_graph.nodes[name].output
        nbytes = meta.nbytes * share if meta else 0
        return self.cost_model.collective_time(kind, nbytes, self.t, nodes=self.nodes, members=self.fewest)

    def _edges(self, node: fx.Node) -> None:
        """The op's own time per strategy, and what each strategy needs of each input."""
        cost = self.chain.op_graph.nodes[node.name]
        for i, strategy in enumerate(self.options[node.name]):
            seconds = self.divided_seconds(node.name) if strategy.divided else cost.forward_s + cost.backward_s
            self.objective.append(round(seconds * _NS) * self.choice[node.name][i])
        for j, arg in enumerate(node.all_input_nodes):
            for i, strategy in enumerate(self.options[node.name]):
                required = strategy.inputs[j]
                if required is None:
                    continue
                copy = strategy.copies(required, self.chain.op_graph.nodes[arg.name].needs_grad)
                self.needs.setdefault((arg.name, required, copy), []).append(self.choice[node.name][i])
                readers = self.readers.setdefault((arg.name, required, copy), [])
                if node not in readers:
                    readers.append(node)

    def _leaves(self, node: fx.Node) -> None:
        """``node`` is read past the block, which takes it replicated: a partial or sharded output
        pays its all-reduce or all-gather here (a vocabulary-parallel embedding's, say)."""
        self.needs.setdefault((node.name, self._boundary(node.name), False), []).append(1)

    def _boundary(self, name: str) -> Placement:
        return boundary_placement(self.chain.op_graph, name, self.t, self.sequence_parallel)

    def _convert(self) -> None:
        """Each value is converted once for every consumer that needs it in one placement, as the
        generated code does (three projections that read one replicated input share its ``f``)."""
        m = self.model
        for (name, required, copy), users in self.needs.items():
            needed = m.new_bool_var(f"{name}_as_{required}{'_copied' if copy else ''}")
            m.add_max_equality(needed, users)
            sources = self.placed.get(name, {self._boundary(name): None})  # None: fixed (a boundary, a buffer)
            whole_tuple = is_tuple_of_tensors(self.fx_nodes[name], self.chain.op_graph)  # split's tuple: its items convert
            share = self._share(name, required, copy)
            for placement, placed in sources.items():
                seconds = self._pair_seconds(placement, required, copy, name, share)
                if seconds is None or whole_tuple and placement != required:
                    m.add_bool_or([needed.Not()] + ([placed.Not()] if placed is not None else []))
                elif seconds:
                    both = needed
                    if placed is not None:
                        both = m.new_bool_var(f"{name}_{placement}_to_{required}{'_copied' if copy else ''}")
                        m.add(both >= needed + placed - 1)
                    term = round(seconds * _NS) * both
                    self.objective.append(term)
                    self.communication.append(term)

    def _share(self, name: str, required: Placement, copy: bool) -> float:
        """What of ``name``'s bytes its gather from the sequence split for the readers that need it
        as ``required`` (``copy``: their gradients summed), or that sum, moves: the products'
        dtype where only products may read it (``autopart.solve.overlap.moves_for_products``)."""
        readers = self.readers.get((name, required, copy), ())
        return moved_share(self.chain.op_graph, name, products=moves_for_products(self.chain.op_graph, name, readers))

    def _pair_seconds(self, source: Placement, required: Placement, copy: bool, name: str, share: float) -> float | None:
        """One conversion's collectives; ``share``: of a gather from the sequence split and of a
        summed gradient, the share of the bytes that moves (``_share``)."""
        step = conversion(source, required, sequence_parallel=self.sequence_parallel)
        if step is None:
            return None
        forward, backward = step
        needs_grad = self.chain.op_graph.nodes[name].needs_grad
        if gathers_for_split_op(source, required, copy):
            return self._seconds(forward, name, share) + (self._seconds("reduce_scatter", name, share) if needs_grad else 0.0)
        seconds = self._seconds(forward, name) + (self._seconds(backward, name) if needs_grad else 0.0)
        if copy:  # Megatron's f: the gradient of a replicated input of a split op is partial
            seconds += self._seconds("all_reduce", name, share)
        return seconds

    def solve(self, time_limit_s: float) -> BlockSharding:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        # One worker: a block's model is small enough that a second worker's start costs more than
        # it finds (1.65x slower with two), and one worker breaks ties the same way every run.
        solver.parameters.num_workers = 1
        solver.parameters.catch_sigint_signal = False  # solves run side by side: Ctrl-C is Python's to handle
        status = solver.solve(self.model)
        assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), "the replicated strategy is always feasible"
        result = self._result(solver)
        levels = [self.objective, self.memory] + ([self._activations()] if self.sequence_parallel else [])
        levels.append(self.communication)
        for objective, then in zip(levels, levels[1:]):
            best = round(solver.objective_value)  # of ``objective``: bound it, and go on to ``then``
            self.model.add(sum(objective) <= best + round(best * TIME_TOLERANCE))
            self.model.minimize(sum(then))
            self.model.clear_hints()  # start from the layout found: it satisfies the new bound
            for bools in (*self.choice.values(), *(placed.values() for placed in self.placed.values())):
                for var in bools:
                    self.model.add_hint(var, solver.value(var))
            status = solver.solve(self.model)
            if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                break  # out of time on a tie-break (a loaded machine): the layout found before stands
            result = self._result(solver)
        return result

    def _result(self, solver: cp_model.CpSolver) -> BlockSharding:
        chosen = {
            n.name: self.options[n.name][next(i for i, b in enumerate(self.choice[n.name]) if solver.value(b))]
            for n in self.members
        }
        fx_nodes = {n.name: n for n in self.chain.op_graph.fx_nodes()}
        parameters = {
            str(fx_nodes[name].target): next(p for p, b in self.placed[name].items() if solver.value(b))
            for name in self.parameters
        }
        costs = self.chain.op_graph.nodes
        compute = sum(
            self.divided_seconds(n) if s.divided else costs[n].forward_s + costs[n].backward_s for n, s in chosen.items()
        )
        saved = sum(self._local_saved_bytes(self.fx_nodes[n], s, chosen) for n, s in chosen.items())
        saved += sum(costs[n].saved_bytes for n in self.block.nodes if n not in chosen)
        total = sum(solver.value(term) for term in self.objective) / _NS
        fused_s, overlapped = fused_seconds(
            self.chain.op_graph, self.members, chosen, self._boundary, self._seconds, t=self.t, cost_model=self.cost_model,
            overlap=self.overlap, priced_share=lambda value: self._share(value, REPLICATE, True))  # fmt: skip
        seeds = local_seed_bytes(costs, self.fx_nodes, self.block.nodes, chosen, overlapped, self.t)
        return BlockSharding(
            strategies=chosen,
            parameters=parameters,
            compute_s=compute,
            communication_s=max(0.0, total - compute + fused_s),
            overlapped=overlapped,
            saved_bytes=saved,
            weight_seed_bytes=seeds,
            sequence_parallel=self.sequence_parallel,
        )

def divided_seconds(op_graph, name: str, t: int, cost_model: CostModel) -> float:
    """Forward and backward of the node's kernels, each on a t-th of the data: the FLOPs and bytes
    shrink, the per-kernel overhead does not."""
    shrunk = [replace(k, flops=k.flops / t, bytes=k.bytes / t) for ks in op_graph.kernels.get(name, ()) for k in ks]
    return cost_model.kernels_time(shrunk)


def fastest_compute_s(chain: BlockChain, *, t: int, cost_model: CostModel) -> list[float]:
    """Per block, a floor under the time of any sharding of it on ``t`` ranks, without solving
    one: the ops a sharding computes (those that make tensors), each at the faster of its whole
    time and its kernels on a t-th of the data, and no collectives. A solved block's ``time_s`` is
    its chosen ops' times, each one of these two, plus collectives, so it is never below this
    (``autopart.solve.layout_bounds`` orders layouts by it before their blocks are solved)."""
    op_graph = chain.op_graph
    fx_nodes = {n.name: n for n in op_graph.fx_nodes()}
    floors = []
    for block in chain.blocks:
        total = 0.0
        for name in block.nodes:
            cost = op_graph.nodes[name]
            if cost.output is None and not is_tuple_of_tensors(fx_nodes[name], op_graph):
                continue  # not a member of the block's sharding model: its time is not in time_s
            total += min(cost.forward_s + cost.backward_s, divided_seconds(op_graph, name, t, cost_model))
        floors.append(total)
    return floors


def _solve_block(
    chain: BlockChain, index: int, t: int, cost_model: CostModel, pinned: dict[str, Placement], nodes: int,
    sequence_parallel: bool = False, overlap: bool = False, fewest: int | None = None,
) -> BlockSharding:
    model = _BlockModel(chain, chain.blocks[index], t, cost_model, pinned, nodes, sequence_parallel, overlap, fewest)
    return model.solve(time_limit_s=20.0)


def _translate(solution: BlockSharding, source: Block, target: Block) -> BlockSharding:
    """A solution of one block applied to an identical block (same signature), node by node."""
    rename = dict(zip(source.nodes, target.nodes))
    parameters = dict(zip(source.parameters, target.parameters))
    return replace(
        solution,
        strategies={rename[n]: s for n, s in solution.strategies.items()},
        overlapped={rename[n]: pieces for n, pieces in solution.overlapped.items()},
        parameters={parameters[p]: placement for p, placement in solution.parameters.items()},
    )


def shard_chain(
    chain: BlockChain, *, tp: int, cost_model: CostModel, nodes: int = 1, sequence_parallel: bool = False,
    overlap: bool = False, fewest: int | None = None,
) -> list[BlockSharding]:
    """The cheapest sharding of every block on ``tp`` ranks (spanning ``nodes`` nodes, ``fewest``
    of them on one, `cost_models.comm.fewest_members`; the
    residual stream split over the sequence between blocks when ``sequence_parallel``; its
    linears' collectives overlapped with their products when ``overlap``, ``autopart.solve.overlap``). The blocks' models are solved side by side, one per core: CP-SAT
    lets go of the interpreter while it solves, and each solve is deterministic on its own."""
    sp = sequence_parallel
    readers: dict[str, list[int]] = {}
    for k, block in enumerate(chain.blocks):
        for p in block.parameters:
            readers.setdefault(p, []).append(k)
    shared = {p: ks for p, ks in readers.items() if len(ks) > 1}
    with ThreadPoolExecutor(max_workers=_SOLVERS) as pool:
        found: dict[tuple, Future] = {}

        def start(k: int, pins: dict[str, Placement]) -> Future:
            """A block's solution depends on the pins of its own parameters alone: each is solved
            once (the blocks that share a weight are solved per candidate, and again once it is chosen)."""
            own = tuple(sorted((p, pins[p]) for p in chain.blocks[k].parameters if p in pins))
            if (k, own) not in found:
                found[k, own] = pool.submit(_solve_block, chain, k, tp, cost_model, dict(own), nodes, sp, overlap, fewest)
            return found[k, own]

        def solve(k: int, pins: dict[str, Placement]) -> BlockSharding:
            return start(k, pins).result()

        first_of: dict[str, int] = {}  # per kind of block (`_alike`), the block solved for all blocks alike
        for k, block in enumerate(chain.blocks):
            first_of.setdefault(_alike(chain, block), k)
            if first_of[_alike(chain, block)] == k or not shared.keys().isdisjoint(block.parameters):
                start(k, {})  # every block's own solution is wanted: the last loop's, or a candidate's
        pinned: dict[str, Placement] = {}
        for parameter, blocks in shared.items():
            candidates = _candidates(parameter, blocks, lambda k: solve(k, {}))
            for candidate in candidates:
                for k in blocks:
                    start(k, {**pinned, parameter: candidate})
            scored = {}  # candidate -> (seconds, parameter bytes per rank) of the blocks that read it
            for candidate in candidates:
                solutions = [solve(k, {**pinned, parameter: candidate}) for k in blocks]
                scored[candidate] = (sum(s.time_s for s in solutions), sum(_rank_bytes(chain, s, tp) for s in solutions))
            pinned[parameter] = _time_then_weights(scored)
        solved: dict[str, tuple[Block, BlockSharding]] = {}
        result = []
        for k, block in enumerate(chain.blocks):
            own_pins = {p: pinned[p] for p in block.parameters if p in pinned}
            key = _alike(chain, block) if not own_pins else f"{block.signature}:{k}"
            if key not in solved:
                solved[key] = (block, solve(k, own_pins))
            first, solution = solved[key]
            result.append(solution if first is block else _translate(solution, first, block))
        return result


def _alike(chain: BlockChain, block: Block) -> str:
    """What blocks share one solution (and its ``compute_s``, `_translate`) by: their signature (the
    same ops, wiring and shapes) and which of their ops run a backward, an input gradient and a
    weight gradient (`autopart.passes.grad_flow`). A frozen layer and a trained one of the same
    signature cost differently: the trained one took the frozen one's solution and with it no
    backward, or, behind a trained embedding whose gradient the frozen layer passes on, no weight
    gradient."""
    ops = [chain.op_graph.nodes[name] for name in block.nodes]
    return block.signature + ":" + "".join(
        "-" if not op.needs_grad else "0iwb"[bool(op.backward_input_s) + 2 * bool(op.backward_weight_s)] for op in ops)


def _rank_bytes(chain: BlockChain, solution: BlockSharding, t: int) -> int:
    return sum(chain.parameter_bytes[p] // (t if placement.kind == "S" else 1) for p, placement in solution.parameters.items())


def _time_then_weights(scored: dict[Placement, tuple[float, int]]) -> Placement:
    """The blocks' own rule across blocks: within ``TIME_TOLERANCE`` of the fastest, the fewest
    parameter bytes (within it too), and of those the fastest."""
    fastest = min(seconds for seconds, _ in scored.values())
    near = {c: v for c, v in scored.items() if v[0] <= fastest * (1 + TIME_TOLERANCE)}
    lightest = min(weights for _, weights in near.values())
    return min((c for c, v in near.items() if v[1] <= lightest * (1 + TIME_TOLERANCE)), key=lambda c: (scored[c][0], c))


def _candidates(parameter: str, blocks: list[int], unpinned: Callable[[int], BlockSharding]) -> list[Placement]:
    """A shared parameter's placements worth trying: replicated, and each that a block reading it
    chooses on its own."""
    found = {REPLICATE}
    for k in blocks:
        found |= {placement for p, placement in unpinned(k).parameters.items() if p == parameter}
    return sorted(found)


def listed_strategies(sharding: BlockSharding, op_graph, fx_nodes: dict[str, fx.Node]) -> dict[str, str]:
    """The strategies a plan lists: those other than the replicated one that emitting assumes for an
    op it does not find (all tensor inputs replicated). A replicated op that leaves an input as it
    is (``b.type_as(y)`` reads only y's dtype, and y may be partial) is listed too. ``fx_nodes``:
    the graph's nodes by name, made once by the caller (a plan lists every block's)."""
    return {
        name: str(strategy)
        for name, strategy in sharding.strategies.items()
        if strategy.output != REPLICATE or strategy.kind or strategy != strategies(fx_nodes[name], op_graph, 1)[0]
    }
