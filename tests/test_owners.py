"""ZeRO-1's owners of whole tensors: the rule (`autopart.ir.owners`) is the one the runtime's two
sharded optimizers run, the memory model counts what the replica owning most holds, and the cut
solver keeps a rank within its memory by that count."""

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopart.driver import CompileOptions
from autopart.ir.errors import InfeasibleError
from autopart.ir.owners import largest_share, partition
from autopart.ir.placement import Placement
from autopart.predict.memory import optimizer_groups, owned_bytes, owner_excess_bytes, state_bytes
from autopart.predict.step_time import rank_tails
from autopart.runtime.optim import make_optimizer
from autopart.runtime.recipe import embedding_parameters, parameter_groups
from autopart.passes.front import build_front
from autopart.solve.assemble import pipeline_problem, plan_from_cuts
from autopart.solve.pipeline import PipelineProblem, evaluate, solve_cuts
from autopart.schedule import stage_placement
from autopart.solve.data_parallel_tail import fsdp_may_pay
from autopart.solve.replica_shares import rank_spans, slowest_replica_bytes
from autopart.solve.search import Layout, SearchSpace, score_layout
from autopart.solve.simulated import simulated_step_s
from tests.distributed import REPO, fork_ranks, gloo_group
from tests.synthetic_chains import SyntheticTable, cluster, random_table

REPLICAS = 3


def test_whole_parameters_go_largest_first_to_the_least_loaded_replica():
    assert partition([[10, 40, 30, 20]], 2) == [[0, 0, 1, 1]]  # 40 -> 0, 30 -> 1, 20 -> 1 (30 < 40), 10 -> 0
    assert partition([[5, 5, 5]], 3) == [[0, 1, 2]]
    assert partition([[7]], 2) == [[0]]


def test_groups_are_partitioned_in_turn_with_the_loads_carried():
    # 40 -> 0, 10 -> 1; then 30 -> 1 (10 < 40), 20 -> 0 (40 = 40: the lower replica)
    assert partition([[40, 10], [30, 20]], 2) == [[0, 1], [1, 0]]
    assert largest_share([[40, 10], [30, 20]], 2) == 60
    assert largest_share([], 4) == 0


def test_the_owner_of_a_table_holds_it_whole_beyond_its_share():
    table, layer = 12 * 1000, 12 * 10  # owned bytes: a vocabulary table and 20 small tensors
    groups = [[table] + [layer] * 20]
    assert owner_excess_bytes(groups, 1) == 0
    assert owner_excess_bytes(groups, 4) == table - (table + 20 * layer) // 4
    # where no tensor outweighs an even share, the owners are within a tensor of it
    assert 0 <= owner_excess_bytes([[layer] * 20], 4) <= layer


def test_owned_bytes_are_what_state_bytes_shares():
    fp32 = 4_000_000
    for dtype in ("fp32", "bf16"):
        for optimizer in ("adamw", "sgd"):
            owned = owned_bytes(fp32, optimizer=optimizer, dp=8, zero=1, dtype=dtype)
            whole = state_bytes(fp32, optimizer=optimizer, dp=1, zero=1, dtype=dtype)
            assert state_bytes(fp32, optimizer=optimizer, dp=8, zero=1, dtype=dtype) == whole - owned + owned // 8
    assert owned_bytes(fp32, optimizer="adamw", dp=8, zero=1, dtype="bf16") == 3 * fp32  # fp32 master, two moments
    assert owned_bytes(fp32, optimizer="adamw", dp=8, zero=1, dtype="fp32") == 2 * fp32  # two moments
    assert owned_bytes(fp32, optimizer="adamw", dp=8, zero=3) == 0 == owned_bytes(fp32, optimizer="adamw", dp=1, zero=1)


class _Tables(nn.Module):
    """Two vocabulary tables, each larger than a third of all, norms (no decay) and linears."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 8)
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))
        self.head = nn.Linear(8, 300, bias=False)

    def forward(self, tokens):
        return self.head(self.mlp(self.norm(self.embed(tokens))))


def _groups(model: nn.Module) -> list[dict]:
    """The recipe's groups, as the runtime makes them (the optimizers take these dicts over)."""
    return parameter_groups(list(model.named_parameters()), weight_decay=0.1, embeddings=embedding_parameters(model))


def _owners(rank: int, port: int, folder: Path) -> None:
    """Each sharded optimizer's owned elements on this replica, after one step, beside the rule's."""
    with gloo_group(rank, port, REPLICAS):
        result = {}
        for shard_masters in (False, True):
            torch.manual_seed(0)
            model = _Tables()
            optimizer = make_optimizer("adamw", _groups(model), 1e-3, zero_group=dist.group.WORLD,
                                       shard_masters=shard_masters)
            model(torch.arange(6).view(2, 3)).sum().backward()
            optimizer.step()
            inner = optimizer.optim
            result[str(shard_masters)] = sum(p.numel() for p in inner.state)
            sizes = [[p.numel() for p in g["params"]] for g in _groups(model)]
            sizes = [sum(sizes, [])] if shard_masters else sizes  # `ShardedMasters` partitions all at once
            result[f"rule {shard_masters}"] = sum(size for group, owners in zip(sizes, partition(sizes, REPLICAS))
                                                  for size, owner in zip(group, owners) if owner == rank)
        (folder / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.multiprocess
def test_the_runtime_owns_what_the_rule_says(tmp_path):
    """torch's ``ZeroRedundancyOptimizer`` (fp32) and `ShardedMasters` (bf16) hold optimizer state
    for the elements `partition` gives each replica, so the largest owner is the model's."""
    assert fork_ranks(_owners, REPLICAS, tmp_path) == [0] * REPLICAS
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(REPLICAS)]
    for key in ("False", "True"):
        assert [r[key] for r in results] == [r[f"rule {key == 'True'}"] for r in results]
    sizes = [[p.numel() for p in g["params"]] for g in _groups(_Tables())]
    assert max(r["False"] for r in results) == largest_share(sizes, REPLICAS)
    assert max(r["True"] for r in results) == largest_share([sum(sizes, [])], REPLICAS) == 300 * 8  # a table
    # fp32: the decayed group first (the head, the two linears' weights), then the embedding table
    # goes beside a linear weight: 2400 + 256
    assert max(r["False"] for r in results) == 2400 + 256 > sum(map(sum, sizes)) / REPLICAS * 1.4  # no even share


def _table_problem(limit: int, **overrides) -> PipelineProblem:
    """Four blocks of equal time; block 0 reads a table whose owned state is 60 (20 a replica's
    share), the others a tensor of 30 each; block 1 saves 20 bytes of activations."""
    owned = {"table": 60, "w1": 30, "w2": 30, "w3": 30}
    fields = dict(block_time_s=(1.0, 1.0, 1.0, 1.0), block_activation_bytes=(0, 20, 0, 0),
                  boundary_transfer_s=(0.0, 0.0, 0.0), parameter_state_bytes={n: b // REPLICAS for n, b in owned.items()},
                  block_parameters=(("table",), ("w1",), ("w2",), ("w3",)), stages=2, microbatches=2, in_flight=(1, 1),
                  memory_limit_bytes=limit, owned_state={n: (b, 0) for n, b in owned.items()}, replicas=REPLICAS)
    fields.update(overrides)
    return PipelineProblem(**fields)


def test_evaluate_counts_the_owner_of_the_table():
    problem = _table_problem(1 << 30)
    # cuts 2|2: rank 0 holds the table and w1, owned 60 and 30 by two replicas: it holds 60, not 30
    assert evaluate(problem, (1,)).rank_memory_bytes == (60 + 20, 30)
    assert evaluate(problem, (0,)).rank_memory_bytes == (60, 30 + 20)
    assert evaluate(_table_problem(1 << 30, owned_state={}), (1,)).rank_memory_bytes == (20 + 10 + 20, 20)


def test_the_cut_solver_keeps_the_owner_within_its_memory():
    # by the shares alone the even cuts fit in 75 bytes (rank 0: 50); the table's owner holds 80
    solution = solve_cuts(_table_problem(75), time_limit_s=10)
    assert solution.evaluation.cuts == (0,)
    assert max(solution.evaluation.rank_memory_bytes) <= 75
    assert solution.status == "optimal"  # the owner's bound rules out only cuts that do not fit
    assert solve_cuts(_table_problem(80), time_limit_s=10).evaluation.cuts == (1,)  # where the owner fits, the even cuts
    with pytest.raises(InfeasibleError, match=r"ZeRO-1 leaves the optimizer state of each tensor whole to one "
                                              r"replica \(.* GiB for table\).*--zero 2 or 3"):
        solve_cuts(_table_problem(59), time_limit_s=10)  # the table alone is 60


@pytest.mark.parametrize("seed", range(24))
def test_the_cut_solver_finds_the_fastest_cuts_that_fit_wherever_some_do(seed):
    rng = random.Random(seed)
    if seed % 2:  # a table among small tensors: its owner's bound settles it
        blocks, stages, dp = rng.randint(4, 8), rng.randint(2, 3), rng.choice([2, 4, 8])
        owned = {f"p{k}": rng.choice([1, 2, 3, 40]) * 1200 for k in range(blocks)}
    else:  # near-equal tensors at dp 2: the excess is the partition's imbalance, which no one tensor bounds
        blocks, stages, dp = rng.randint(12, 16), 3, 2
        owned = {f"p{k}": rng.randint(10_000, 10_300) for k in range(blocks)}
    problem = PipelineProblem(
        block_time_s=tuple(rng.uniform(1e-3, 5e-3) for _ in range(blocks)),
        block_activation_bytes=tuple(rng.randint(1, 40) * 100 for _ in range(blocks)),
        boundary_transfer_s=(0.0,) * (blocks - 1), parameter_state_bytes={n: b // dp for n, b in owned.items()},
        block_parameters=tuple((f"p{k}",) for k in range(blocks)), stages=stages, microbatches=2,
        in_flight=tuple(min(stages - s, 2) for s in range(stages)), memory_limit_bytes=1 << 40,
        owned_state={n: (b, 0) for n, b in owned.items()}, replicas=dp)
    every = [evaluate(problem, cuts) for cuts in itertools.combinations(range(blocks - 1), stages - 1)]
    peaks = sorted(max(e.rank_memory_bytes) for e in every)
    for limit in sorted({peaks[0] - 1, peaks[0], peaks[len(peaks) // 2]}):
        bounded = replace(problem, memory_limit_bytes=limit)
        if limit < peaks[0]:
            with pytest.raises(InfeasibleError):
                solve_cuts(bounded, time_limit_s=10)
            continue
        solution = solve_cuts(bounded, time_limit_s=10)
        assert max(solution.evaluation.rank_memory_bytes) <= limit
        assert solution.status == "optimal"
        best = min(e.objective_s for e in every if max(e.rank_memory_bytes) <= limit)
        assert solution.evaluation.objective_s == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_compiler_gives_each_tensor_its_owned_state_and_group(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    options = CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, dp=4, zero=1, microbatches=2,
                             micro_batch_size=1, schedule="1f1b", optimizer="adamw", dtype=dtype, measure=False)
    front = build_front(options, 1)
    problem = pipeline_problem(options, front, 2)
    module = front.spec.module
    shapes = {n: p.shape for n, p in module.named_parameters(remove_duplicate=False)}
    tables = set(embedding_parameters(module))
    assert problem.replicas == 4 and set(problem.owned_state) == set(front.chain.parameter_bytes)
    for name, (owned, group) in problem.owned_state.items():
        fp32 = front.chain.parameter_bytes[name]
        assert owned == (3 if dtype == "bf16" else 2) * fp32  # AdamW's moments, and the fp32 master under bf16
        decayed = len(shapes[name]) >= 2 and name not in tables
        assert group == (0 if dtype == "bf16" or decayed else 1)
    assert {group for _, group in problem.owned_state.values()} == ({0} if dtype == "bf16" else {0, 1})
    # the plan's memory counts each stage's owners: its optimizer's tensors partitioned as the runtime does
    cuts = (len(front.chain.blocks) // 2,)
    plan = plan_from_cuts(options, front, problem, cuts, options.batch_shape(), ("pinned", 0.0, 0.0))
    shares = evaluate(replace(problem, owned_state={}), cuts).rank_memory_bytes
    per_element = 12 if dtype == "bf16" else 8
    for stage, memory, share in zip(plan.stages, plan.predicted.memory_bytes, shares):
        named = {n: p for n, p in module.named_parameters(remove_duplicate=False) if n in stage.parameters}
        groups = [[p.numel() * per_element for p in g["params"]]
                  for g in parameter_groups(named.items(), weight_decay=None, embeddings=tables)]
        groups = [sum(groups, [])] if dtype == "bf16" else groups
        excess = largest_share(groups, 4) - sum(size // 4 for group in groups for size in group)
        assert memory - share == excess
    assert plan.predicted.memory_bytes[0] - shares[0] > 0  # the token table's owner
    assert pipeline_problem(replace(options, zero=2), front, 2).owned_state == {}


def test_the_search_cuts_where_the_table_s_owner_fits():
    """Six blocks of equal time, a table of 8,000 bytes in the first (synthetic fp32 Adam: its
    owner holds its two moments, 16,000 bytes, where the shares count 4,000): the even cuts fit by
    the shares alone, but the rank holding the table and two layers holds 32,400 bytes with its
    owner; the search's cuts leave that rank one layer."""
    table = SyntheticTable(forward_s=(1.0,) * 6, saved_bytes=(1,) * 6, parameter_bytes=(8000,) + (100,) * 5,
                           boundary_bytes=1)
    devices = cluster(memory_bytes=33_000, gpus_per_node=8)  # 32,340 bytes beside the overhead
    space = SearchSpace(world_size=8, global_batch_size=16, gpus_per_node=8)
    layout = Layout(pp=2, tp=1, dp=4, micro_batch_size=1, microbatches=4, schedule="1f1b", zero=1)
    scored = score_layout(layout, table, devices, space)
    assert scored is not None and scored.cut.cuts == (1,)
    owner = devices.overhead_bytes + 2 * 8000 + 16000  # the table's weights, gradients and its owned moments
    assert owner <= scored.cut.rank_memory_bytes[0] <= devices.memory_bytes
    roomy = cluster(memory_bytes=1 << 30, gpus_per_node=8)
    assert score_layout(layout, table, roomy, space).cut.cuts == (2,)  # the even cuts, where the owner fits


def test_the_search_waits_for_the_step_of_the_slowest_replica_too():
    """The search's step, closed form and simulated, counts what the compiled plan's does
    (`test_a_rank_waits_for_the_step_of_its_slowest_replica`): the replica that owns the first
    rank's 8,000-byte table steps it alone, 8,000 bytes' step where an even share is 2,050."""
    table = SyntheticTable(forward_s=(1.0,) * 6, saved_bytes=(1,) * 6, parameter_bytes=(8000,) + (100,) * 5,
                           boundary_bytes=1)
    space = SearchSpace(world_size=8, global_batch_size=16, gpus_per_node=8)
    layout = Layout(pp=2, tp=1, dp=4, micro_batch_size=1, microbatches=4, schedule="1f1b", zero=1)
    stepping, free = (cluster(memory_bytes=1 << 30, gpus_per_node=8, optimizer_s_per_byte=rate) for rate in (1e-4, 0.0))
    scored, unstepped = (score_layout(layout, table, devices, space) for devices in (stepping, free))
    assert scored.cut.cuts == unstepped.cut.cuts == (2,)
    assert scored.estimate_s - unstepped.estimate_s == pytest.approx(1e-4 * 8000)
    simulated = simulated_step_s(scored, table, stepping) - simulated_step_s(unstepped, table, free)
    assert simulated == pytest.approx(1e-4 * 8000)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_the_search_s_slowest_replica_is_the_partition_of_the_rank_s_tensors(seed, schedule):
    """`slowest_replica_bytes`, which answers ranks of alike blocks once, is the largest share of
    the rank's tensors in the optimizer's groups (`autopart.ir.owners`, as the runtime owns them):
    blocks of two or three tensors of a few sizes, some decayed, one read twice by its block, and a
    weight tied between the first and last block and with a middle one (in both stages' modules
    where two of a rank's stages read it: the V's first rank holds the first and last stage)."""
    rng = random.Random(seed)
    blocks = 12
    names = [tuple(f"w{k}.{i}" for i in range(rng.choice((2, 3)))) for k in range(blocks)]
    names[-1] += ("w0.0",)
    names[5] += ("w0.0", names[5][0])
    costs = random_table(rng, layers=(blocks - 2) // 2).chain_costs(micro_batch_size=1, tp=1, dtype="fp32").changed(
        block_parameters=tuple(names), parameter_bytes={n: rng.choice((100, 200, 300)) for ns in names for n in ns},
        decayed_parameters=frozenset(n for ns in names for n in ns if n.endswith(".0")))
    for dtype in ("fp32", "bf16"):
        layout = Layout(pp=3, tp=1, dp=3, micro_batch_size=1, microbatches=6, schedule=schedule, chunks=2, zero=1,
                        dtype=dtype)
        stepped = slowest_replica_bytes(layout, costs)
        for _ in range(20):
            cuts = tuple(sorted(rng.sample(range(blocks - 1), 5)))
            for spans in rank_spans(cuts, blocks, stage_placement(schedule, ranks=3, chunks=2)):
                held = [p for first, last in spans
                        for p in dict.fromkeys(p for k in range(first, last + 1) for p in costs.block_parameters[k])]
                groups = optimizer_groups(held, dtype=dtype, decayed=costs.decayed_parameters)
                assert stepped(spans) == largest_share([[costs.parameter_bytes[n] for n in g] for g in groups], 3)


def test_the_search_tries_zero_2_where_zero_1_s_owners_step_unevenly():
    """ZeRO-2 shards every tensor evenly: where ZeRO-1's all-reduce hides behind the backward but
    its slowest replica steps the 8,000-byte table alone, ZeRO-2 is faster, and the search's test of
    whether it may pay (`fsdp_may_pay`, which spares it the ZeRO-2 twin otherwise) says so."""
    table = SyntheticTable(forward_s=(10.0,) * 6, saved_bytes=(1,) * 6, parameter_bytes=(100, 8000) + (100,) * 4,
                           boundary_bytes=1)
    devices = replace(cluster(memory_bytes=1 << 30, gpus_per_node=8, optimizer_s_per_byte=1e-2),
                      reduction_overlaps=True)
    space = SearchSpace(world_size=8, global_batch_size=16, gpus_per_node=8, zero=(1, 2))
    layout = Layout(pp=2, tp=1, dp=4, micro_batch_size=1, microbatches=4, schedule="1f1b", zero=1)
    level_1, level_2 = (score_layout(replace(layout, zero=zero), table, devices, space) for zero in (1, 2))
    assert level_2.estimate_s < level_1.estimate_s
    assert fsdp_may_pay(level_1, table, devices)


def test_a_rank_waits_for_the_step_of_its_slowest_replica(tmp_path, monkeypatch):
    """The step ends once every owner has shared its weights: a rank's optimizer time is the
    slowest replica's over the tensors it owns, not 1/dp of all of them."""
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    options = CompileOptions(model=REPO / "examples" / "gpt.py", pp=1, dp=4, zero=1, microbatches=2,
                             micro_batch_size=1, schedule="1f1b", optimizer="adamw", dtype="bf16", measure=False,
                             device="h100-sxm")  # a spec: timings the machine's load does not move
    front = build_front(options, 1)
    plan = plan_from_cuts(options, front, pipeline_problem(options, front, 2), (), options.batch_shape(),
                          ("pinned", 0.0, 0.0))
    params = dict(front.spec.module.named_parameters(remove_duplicate=False))
    held = list(plan.stages[0].parameters)
    owners = partition([[params[n].numel() for n in held]], 4)[0]  # bf16: one group
    time = front.cost_model.optimizer_time
    per_replica = [time("adamw", [(params[n].shape, "float32") for n, o in zip(held, owners) if o == r])
                   for r in range(4)]
    tails = rank_tails(options, front, list(plan.stages), {n: [0] for n in held}, None)
    assert tails[0] == pytest.approx(max(per_replica))
    assert max(per_replica) > sum(per_replica) / 4 * (1 + 1e-4)  # the replicas' steps differ: not an even share


def test_a_tensor_parallel_rank_steps_its_shards(tmp_path, monkeypatch):
    """The optimizer step of a tensor-parallel rank is timed on its shards of the split weights
    (the whole of the replicated ones), not on the whole tensors."""
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    options = CompileOptions(model=REPO / "examples" / "gpt.py", pp=1, tp=2, microbatches=2, micro_batch_size=1,
                             schedule="1f1b", optimizer="adamw", measure=False, device="h100-sxm")
    front = build_front(options, 1)
    plan = plan_from_cuts(options, front, pipeline_problem(options, front, 2), (), options.batch_shape(),
                          ("pinned", 0.0, 0.0))
    params = dict(front.spec.module.named_parameters(remove_duplicate=False))
    split = plan.stages[0].parameter_placements
    assert split  # some weights are split
    shards = [tuple(s // 2 if d == Placement.parse(split[n]).dim else s for d, s in enumerate(params[n].shape))
              if n in split else tuple(params[n].shape) for n in plan.stages[0].parameters]
    tails = rank_tails(options, front, list(plan.stages), {n: [0] for n in plan.stages[0].parameters}, None)
    assert tails[0] == pytest.approx(front.cost_model.optimizer_time("adamw", [(s, "float32") for s in shards]))
