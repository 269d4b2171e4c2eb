"""--tp-overlap: the sequence-parallel linears cut into pieces, each collective beside the products
(``autopart.runtime.overlapped``), what the step model charges for them (``autopart.solve.overlap``),
and the programs trained under gloo against one process."""

import re
from dataclasses import replace

import pytest

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ConfigError, PlanError
from autopart.ir.plan import load_plan
from autopart.passes.front import build_front
from autopart.solve.overlap import exposed_s, fused_linears, piece_counts
from autopart.solve.sequence import boundary_placement
from autopart.tools.verify import verify
from cost_models import get_cost_model
from tests.distributed import FREE_LINKS, REPO, run_cli_here, run_program
from tests.test_sequence_parallel import collectives, megatron_layers

LLAMA = REPO / "examples" / "llama.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks", [2, 3])
def test_overlapped_linears_equal_the_plain_ones(ranks):
    """Every rank its own slice and weights, 1 to t pieces, fp32 and bf16 autocast: the outputs and
    the gradients of the slice, the input and the weights are the plain functions'."""
    result = run_program([str(REPO / "tests" / "overlapped_rank.py"), "12"], ranks, timeout=180)
    assert result.stdout.count("ok") == ranks


def test_pieces_priced_are_those_up_to_the_group_that_divide_the_slice():
    assert piece_counts(512, 4) == [2, 4]
    assert piece_counts(6, 4) == [2, 3]
    assert piece_counts(7, 4) == []  # nothing divides: the plain linear's one collective
    assert piece_counts(8, 1) == []


def _proportional(forward: float, input_grad: float, weight_grad: float):
    """Products whose time is proportional to the rows they multiply (no launch cost)."""
    whole = {"forward": forward, "input": input_grad, "weight": weight_grad}
    return lambda which, fraction: whole[which] * fraction


@pytest.mark.parametrize("kind", ["gathered", "scattered"])
def test_exposed_collectives_lie_between_none_and_all_of_them(kind):
    products = _proportional(4e-3, 4e-3, 4e-3)
    for pieces, t in ((2, 2), (4, 4), (3, 8)):
        for gather, scatter in ((1e-5, 1e-5), (1e-3, 2e-3), (1e-1, 1e-1)):
            ahead, behind = exposed_s(kind, pieces=pieces, t=t, products=products, gather_s=gather, scatter_s=scatter)
            whole = pieces * ((2 * gather + scatter) if kind == "gathered" else (gather + scatter))
            assert 0 <= ahead + behind <= whole + 1e-12
    # products that take no time hide nothing; collectives that take none add nothing
    ahead, behind = exposed_s(kind, pieces=4, t=4, products=_proportional(0, 0, 0), gather_s=1e-3, scatter_s=2e-3)
    assert ahead + behind == pytest.approx(4 * ((2e-3 + 2e-3) if kind == "gathered" else 3e-3))
    assert exposed_s(kind, pieces=4, t=4, products=products, gather_s=0.0, scatter_s=0.0) == pytest.approx((0.0, 0.0))


def test_long_products_hide_all_but_what_no_product_can_run_beside():
    """A gathered linear multiplies its own rows while the first piece is gathered: with products
    far longer than the collectives nothing of its forward shows. A scattered one's last piece is
    reduce-scattered after the last product: that piece stays."""
    long = _proportional(1.0, 1.0, 1.0)
    ahead, behind = exposed_s("gathered", pieces=4, t=4, products=long, gather_s=1e-3, scatter_s=1e-3)
    assert ahead == pytest.approx(0.0, abs=1e-12)
    assert behind == pytest.approx(0.0, abs=1e-12)  # the last reduce-scatter runs beside the weight gradient
    ahead, behind = exposed_s("scattered", pieces=4, t=4, products=long, gather_s=1e-3, scatter_s=1e-3)
    assert ahead == pytest.approx(1e-3)
    assert behind == pytest.approx(0.0, abs=1e-12)


def test_the_streams_run_in_the_codes_order():
    """One case per kind, worked by hand (t 2, 2 pieces, products of 1 s per whole, a piece's
    collective 0.6 s). Gathered forward: the own rows' product (0.5 s) beside the first gather
    (both gathers start at once: 0.6, 1.2), each half of the others' rows (0.25 s) after its gather:
    ends at 1.45. Scattered forward: each piece's product (0.5 s), then its reduce-scatter, the
    second after the first: ends at 1.7. Gathered backward: both gathers first (0.6, 1.2), then
    each reduce-scatter after its input-gradient piece (0.5 s each: 1.8, 2.4), the weight gradient
    (1 s) after the last gather (2.2): ends at 2.4. Scattered backward: the own rows' input
    gradient (0.5 s) beside the first gather, each half of the others' after its gather (0.6,
    1.2), the weight gradient after the last: 2.45."""
    products = _proportional(1.0, 1.0, 1.0)
    gathered = exposed_s("gathered", pieces=2, t=2, products=products, gather_s=0.6, scatter_s=0.6)
    scattered = exposed_s("scattered", pieces=2, t=2, products=products, gather_s=0.6, scatter_s=0.6)
    assert gathered == pytest.approx((1.45 - 1.0, 2.4 - 2.0))
    assert scattered == pytest.approx((1.7 - 1.0, 2.45 - 2.0))


def test_smaller_products_cost_their_launches():
    """Cut in pieces, a product launches once per piece: that time is added too, so that where
    launches outweigh what the pieces hide, the linear is not cut."""
    launch = 1e-4

    def products(which, fraction):
        return launch + 1e-3 * fraction

    ahead, _ = exposed_s("scattered", pieces=4, t=4, products=products, gather_s=0.0, scatter_s=0.0)
    assert ahead == pytest.approx(3 * launch)


def _layer_model(tmp_path, layers: int, split_qkv: bool = False):
    return megatron_layers(tmp_path / f"layers_{layers}{'_split' if split_qkv else ''}.py", layers=layers,
                           split_qkv=split_qkv)


def _communication_s(model, *, overlap: bool, dtype: str = "fp32", sp: bool = True) -> float:
    options = CompileOptions(model=model, tp=8, sp=sp, microbatches=1, micro_batch_size=1, device="h100-sxm",
                             tp_overlap=overlap, dtype=dtype)  # fmt: skip
    return sum(sharding.communication_s for sharding in build_front(options, 1).shardings)


def test_a_layer_pays_each_collective_its_code_runs_and_overlap_hides_most(tmp_path):
    """Megatron-SP's layer runs two gathered linears (the gather in forward; in backward the
    gradient's reduce-scatter and the slice gathered again) and two reduce-scattered ones (and the
    gradient's gather): six all-gathers and four reduce-scatters of s·b·h. Beside them, small
    ones: the gradients of the two norms' weights and biases and of the MLP's output bias are
    all-reduced, the projection's bias is gathered (and its gradient reduce-scattered). Each is
    priced as the cost model prices one, in the CP-SAT objective's nanoseconds. Overlapped, less
    stays, and more than the small ones, which stay whole (at this width each piece's latency
    costs about what its product hides: the gain is small)."""
    per_layer = {}
    for overlap in (False, True):
        two, three = (_communication_s(_layer_model(tmp_path, n), overlap=overlap) for n in (2, 3))
        per_layer[overlap] = three - two
    cost_model = get_cost_model("h100-sxm")

    def seconds(kind: str, nbytes: int) -> float:
        return cost_model.collective_time(kind, nbytes, 8)

    big, small = 2048 * 1 * 4096 * 2, 4096 * 2  # bf16 activations of one sequence; one bias
    small_ones = 5 * seconds("all_reduce", small) + seconds("all_gather", small) + seconds("reduce_scatter", small)
    expected = 6 * seconds("all_gather", big) + 4 * seconds("reduce_scatter", big) + small_ones
    assert per_layer[False] == pytest.approx(expected, rel=1e-5)
    assert small_ones < per_layer[True] < 0.95 * per_layer[False]

    # in bf16 the norms run in fp32 (autocast's list) and hand the gathered linears fp32 outputs,
    # which they gather cast to the bf16 their products read: the same bytes move
    two, three = (_communication_s(_layer_model(tmp_path, n), overlap=False, dtype="bf16") for n in (2, 3))
    assert three - two == pytest.approx(expected, rel=1e-3)

    # with q, k and v three linears (Llama's), the normed input is gathered once for the three and
    # kept whole (``tp.gather_for_products``): one all-gather less, and still the bf16 they read
    two, three = (_communication_s(_layer_model(tmp_path, n, split_qkv=True), overlap=False, dtype="bf16")
                  for n in (2, 3))
    assert three - two == pytest.approx(expected - seconds("all_gather", big), rel=1e-3)


@pytest.mark.parametrize("split_qkv", [False, True])
def test_without_sp_a_bf16_layer_sums_its_products_gradients_in_bf16(tmp_path, split_qkv):
    """Without sequence parallelism a layer all-reduces the outputs of its two row-parallel
    linears in forward, and in backward the gradients of the inputs of its column-parallel ones
    (Megatron's g and f): four all-reduces of s·b·h, all bf16 as Megatron's. The norms' outputs are
    fp32 under autocast, but only products read them, so their gradients come back in bf16."""
    two, three = (_communication_s(_layer_model(tmp_path, n, split_qkv=split_qkv), overlap=False, dtype="bf16", sp=False)
                  for n in (2, 3))
    all_reduce = get_cost_model("h100-sxm").collective_time("all_reduce", 2048 * 1 * 4096 * 2, 8)
    assert three - two == pytest.approx(4 * all_reduce, rel=1e-4)


def test_only_an_activation_that_only_products_read_moves_as_they_read_it():
    """A weight, or a view of one (``w.t()``), keeps its gradient's sum in fp32 wherever it is
    read; an activation moves as the products that read it, unless anything else reads it too."""
    import types

    import torch
    from torch import fx, nn

    from autopart.solve.overlap import moves_for_products, reads_the_batch

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 4))

        def forward(self, x):
            normed = torch.nn.functional.layer_norm(x, (4,))
            cast = self.w.type_as(x)[: x.size(1)]  # a weight cast as the batch, cut to its size: a weight
            return torch.mm(normed, self.w.t()) + torch.relu(normed) + torch.mm(normed, cast)

    traced = fx.symbolic_trace(Model())
    nodes = {n.name: n for n in traced.graph.nodes}
    metadata = {"size": types.SimpleNamespace(output=None, constant=4)}  # what the annotation says of a size
    op_graph = types.SimpleNamespace(graph=types.SimpleNamespace(module=traced),
                                     nodes={n: metadata.get(n, types.SimpleNamespace(output=True)) for n in nodes})
    read = [n for n in nodes if reads_the_batch(op_graph, n)]
    assert read == ["x", "layer_norm", "size", "mm", "relu", "add", "mm_1", "add_1", "output"], read
    assert not moves_for_products(op_graph, "t", [nodes["mm"]])  # a view of a weight
    assert not moves_for_products(op_graph, "getitem", [nodes["mm_1"]])
    assert moves_for_products(op_graph, "layer_norm", [nodes["mm"]])
    assert not moves_for_products(op_graph, "layer_norm", [nodes["mm"], nodes["relu"]])


def _cut(source: str) -> int:
    """The overlapped linears a stage program runs (``overlapped.NAME`` calls, each call of a layer
    method counted)."""
    return sum(collectives(source, ("linear_reduce_scatter", "gathered_linear"), module="overlapped").values())


def test_the_code_cuts_the_linears_the_plan_prices_in_the_pieces_it_priced(tmp_path):
    options = CompileOptions(model=LLAMA, tp=2, microbatches=2, global_batch_size=2, device=str(FREE_LINKS),
                             tp_overlap=True)  # fmt: skip
    plan, out = compile_to_directory(options, tmp_path / "out")
    assert plan.tp_overlap and load_plan(out / "plan.json") == plan
    priced = {name: pieces for stage in plan.stages for name, pieces in stage.overlapped.items()}
    assert priced and set(priced.values()) == {2}  # a rank's 8 rows of the sequence, 2 ranks
    source = "".join(p.read_text() for p in sorted((out / "stages").glob("stage_*.py")))
    cut = _cut(source)
    assert cut == len(priced)
    assert re.findall(r"= overlapped\.\w+\(.*, 2\)", source)  # the pieces, as the plan has them
    assert f"{len(priced)} linears run in pieces beside their collectives" in (out / "report.md").read_text()


@pytest.mark.parametrize("pp", [1, 2])
def test_a_linear_that_reads_a_value_its_stage_made_whole_is_not_cut(tmp_path, pp):
    """GPT's tied head reads the final norm, which its block runs whole under free links: the head's
    block priced gathering it from the boundary's sequence split, but within a stage the head gets it
    whole and the code gathers nothing, so the plan does not cut it (it named it, and emit refused)."""
    how = dict(pp=pp, tp=2, microbatches=pp, global_batch_size=2 * pp, device=str(FREE_LINKS), tp_overlap=True)
    plan, out = compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", **how), tmp_path / "out")
    listed = sum(len(stage.overlapped) for stage in plan.stages)
    source = "".join(p.read_text() for p in sorted((out / "stages").glob("stage_*.py")))
    head = re.search(r"(\w+) = F\.linear\(\w+, self\.wte\.weight\)", source)  # the tied head, as the code runs it
    assert head and head.group(1) not in plan.stages[-1].overlapped
    assert listed and _cut(source) > 0  # the other linears are still cut


def _fused_by_the_solver(plan, options) -> set:
    """The linears the sharding solver priced fused with their collectives (``FusedLinear``s)."""
    front = build_front(options, plan.schedule.micro_batch_size)
    fx_nodes = {n.name: n for n in front.op_graph.fx_nodes()}
    fused = set()
    for block, sharding in zip(front.chain.blocks, front.shardings):
        members = [fx_nodes[n] for n in block.nodes if n in sharding.strategies]
        placement_of = lambda name: boundary_placement(front.op_graph, name, options.tp, True)  # noqa: E731
        fused |= set(fused_linears(front.op_graph, members, sharding.strategies, placement_of))
    return fused


def _every_fused_linear_cut(plan, options, pieces: int = 2):
    """``plan`` with every linear the code can fuse cut in ``pieces``: in bf16 at these sizes no
    cut pays (each piece's collective latency outweighs what it hides), and the programs are to be
    tested all the same."""
    fused = {f.linear for f in _fused_by_the_solver(plan, options)}
    stages = tuple(replace(stage, overlapped={n: pieces for n in stage.nodes if n in fused}) for stage in plan.stages)
    return replace(plan, stages=stages)


def test_the_solver_prices_the_gathered_linears_the_code_fuses(tmp_path):
    """A post-norm layer's norm output is read by the next linear, gathered, and by the residual
    add, split over the sequence: the gather has one reader, so the code fuses it with the linear
    (``tp.gathered_linear``: gathered again in backward, the slice kept), and the solver prices and
    holds the same linears fused (it took any second reader to share the gather)."""
    options = CompileOptions(model=REPO / "tests" / "models" / "post_norm.py", tp=2, microbatches=1, global_batch_size=1,
                             device="h100-sxm", dtype="bf16")  # fmt: skip
    plan, out = compile_to_directory(options, tmp_path / "out")
    fused = {f.linear for f in _fused_by_the_solver(plan, options) if f.kind == "gathered"}
    found = collectives("".join(p.read_text() for p in (out / "stages").glob("stage_*.py")))
    assert len(fused) == found["gathered_linear"] == 2 * 2, (fused, found)  # each layer's QKV and MLP input


@pytest.mark.multiprocess
@pytest.mark.parametrize("pp, dtype, schedule", [(1, "fp32", "1f1b"), (2, "bf16", "1f1b"), (2, "fp32", "zb-h1")])
def test_overlapped_programs_train_like_one_process(tmp_path, pp, dtype, schedule):
    how = dict(pp=pp, tp=2, microbatches=2 * pp, global_batch_size=2 * pp, dtype=dtype, device=str(FREE_LINKS),
               tp_overlap=True, schedule=schedule)  # fmt: skip
    plan = autopart.compile(LLAMA, **how)
    if dtype == "bf16":
        plan = _every_fused_linear_cut(plan, CompileOptions(model=LLAMA, **how))
    out = autopart.emit(plan, tmp_path / "out")
    source = "".join(p.read_text() for p in (out / "stages").glob("stage_*.py"))
    assert "overlapped.linear_reduce_scatter(" in source and "overlapped.gathered_linear(" in source
    result = verify(out, steps=2)
    assert result.matches, result.failures


@pytest.mark.parametrize("pieces", [2, 4])
def test_the_code_cuts_each_linear_in_the_plans_pieces(tmp_path, pieces):
    how = dict(tp=4, microbatches=2, global_batch_size=2, device=str(FREE_LINKS), tp_overlap=True)
    plan = _every_fused_linear_cut(autopart.compile(LLAMA, **how), CompileOptions(model=LLAMA, **how), pieces)
    listed = sum(len(stage.overlapped) for stage in plan.stages)
    source = "".join(p.read_text() for p in (autopart.emit(plan, tmp_path / "out") / "stages").glob("stage_*.py"))
    calls = re.findall(r"= overlapped\.\w+\(.*, (\d+)\)", source)
    assert listed and set(calls) == {str(pieces)}
    assert _cut(source) == listed


def test_a_plan_that_cuts_what_the_code_cannot_is_refused(tmp_path):
    how = dict(tp=2, pp=2, microbatches=4, global_batch_size=4, device=str(FREE_LINKS), tp_overlap=True)
    plan = autopart.compile(LLAMA, **how)
    wrong = {**plan.stages[0].overlapped, "no_such_linear": 2}
    edited = replace(plan, stages=(replace(plan.stages[0], overlapped=wrong), *plan.stages[1:]))
    with pytest.raises(PlanError, match="no_such_linear"):
        autopart.emit(edited, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    edited.save(tmp_path / "plan.json")  # through --plan: the entry that differs, in one line
    result = run_cli_here("compile", str(LLAMA), "-o", str(tmp_path / "c"), "--plan", str(tmp_path / "plan.json"),
                          "--device", str(FREE_LINKS))
    assert result.returncode == 2 and "overlapped.no_such_linear" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_overlap_needs_sequence_parallelism(tmp_path):
    with pytest.raises(ConfigError, match="needs sequence parallelism"):
        CompileOptions(model=LLAMA, tp=2, sp=False, tp_overlap=True)
    result = run_cli_here("compile", str(LLAMA), "-o", str(tmp_path / "out"), "--tp", "2", "--no-sp", "--tp-overlap")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()
