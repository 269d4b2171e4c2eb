"""Activation recompute and bf16, in one process: the runtime's forward computes exactly what it
computes without recompute, running the forward once more and the kept ops no more; the bytes it
leaves for the backward are those `autopart.passes.recompute` predicts; the plan carries the modes and
the dtype, and its figures follow them."""

import gc
import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import autopart
from autopart.ir.model_file import load_model_file
from autopart.driver import CompileOptions
from autopart.ir.plan import Plan
from autopart.ir.recompute import RECOMPUTE_MODES, keeps_output
from autopart.passes.recompute import (
    batch_inputs, checkpointed_layers, recompute_cost, stage_input_bytes, transient_microbatches,
)
from autopart.codegen.layers import layer_instances
from autopart.runtime.backward import backward_full, backward_input, backward_weight
from autopart.runtime.forward import StageForward, selective_policy
from autopart.runtime.stage import load_stage
from autopart.schedule import build_schedule
from tests.distributed import REPO

GPT = REPO / "examples" / "gpt.py"
CPU = torch.device("cpu")


def _gpt():
    spec = importlib.util.spec_from_file_location("autopart_test_gpt", GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Counted(nn.Module):
    """A GPT block with dropout (so the recompute must replay the random numbers), counting its calls."""

    def __init__(self):
        super().__init__()
        gpt = _gpt()
        self.block = gpt.Block(gpt.GPTConfig())
        self.dropout = nn.Dropout(0.1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.dropout(self.block(x))


class KeptOps(TorchDispatchMode):
    """Counts the forward kernels whose outputs selective recompute keeps (addmm, attention)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += keeps_output(func) and "backward" not in str(func) and func is not torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def _train_once(module: Counted, mode: str, *, split: bool, dtype: str):
    """F then B (or I then W) of one microbatch; the random state moves on between them, as in a pipeline."""
    module.zero_grad(set_to_none=True)
    module.calls = 0
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    # bf16 (working weights) stages receive a bf16 residual stream; CPU autocast runs a norm in its
    # input's dtype, so an fp32 input could not meet the bf16 norm weights there
    x = (x.to(torch.bfloat16) if dtype == "bf16" else x).requires_grad_(True)
    grad = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    forward = StageForward(module, recompute=mode, dtype=dtype, device=CPU, split_backward=split)
    torch.manual_seed(5)
    with KeptOps() as kept:
        out, rebuild = forward(x)
        torch.manual_seed(99)
        if split:
            if rebuild is not None:
                out = forward.rebuild(rebuild)
            found, pending = backward_input([out], [grad.to(out.dtype)], [x], list(module.parameters()))
            backward_weight(pending)
        else:
            found = backward_full([out], [grad.to(out.dtype)], [x])
    grads = {n: p.grad for n, p in module.named_parameters()}
    return out.detach(), found[0], grads, module.calls, kept.count


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-autocast"])
@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_computes_exactly_what_keeping_computes(mode, split, dtype):
    module = Counted()
    out, input_grad, grads, calls, kept = _train_once(module, "none", split=False, dtype=dtype)
    assert (calls, kept) == (1, 5)  # c_attn, attention, c_proj, c_fc, mlp c_proj
    again = _train_once(module, mode, split=split, dtype=dtype)
    assert torch.equal(again[0], out) and torch.equal(again[1], input_grad)
    for name, grad in grads.items():
        assert torch.equal(again[2][name], grad), name
    assert again[3] == 2, "the forward runs once more, in backward, whether B or I and W follow"
    assert again[4] == (5 if mode == "selective" else 10), "selective runs the kept ops once, full twice"


def test_checkpoint_alone_recomputes_for_each_autograd_call():
    """Why a split backward rebuilds the graph itself: non-reentrant checkpoint recomputes once
    per autograd call, so I and W (two groups of weights here) would run the forward three times
    more, and selective checkpointing refuses a second recompute outright."""
    module = Counted()
    x = torch.randn(2, 32, 64).requires_grad_(True)
    out = checkpoint(module, x, use_reentrant=False)
    _, pending = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    backward_weight(pending)
    assert module.calls > 2
    contexts = lambda: create_selective_checkpoint_contexts(selective_policy)  # noqa: E731
    out = checkpoint(module, x, use_reentrant=False, context_fn=contexts)
    _, pending = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    with pytest.raises(RuntimeError, match="backward an extra time"):
        backward_weight(pending)


class Created(TorchDispatchMode):
    """Weak references to every tensor the ops inside it create."""

    def __init__(self):
        super().__init__()
        self.storages: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.storages.append((StorageWeakRef(storage), storage._cdata, storage.nbytes()))
        return out


def held_for_backward(forward: StageForward, args: list) -> tuple[int, object]:
    """Bytes that a forward leaves for the backward: what autograd saved (saved-tensor hooks: all of
    it without recompute, the stage's arguments under checkpoint) and what is still alive of the
    tensors the forward made (what the selective policy kept), not counting the stage's weights and
    outputs."""
    packed: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        packed[storage._cdata] = storage.nbytes()
        return tensor

    created = Created()
    forward.begin_step()  # bf16: the step's working weights, cast before any microbatch's forward
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), created:
        out, _ = forward(*args)
    gc.collect(0)  # the youngest generation: what a forward leaves in reference cycles
    weights = [*forward.module.parameters(), *forward.module.buffers(), *forward.working.values()]
    own = {t.untyped_storage()._cdata for t in weights}
    own |= {t.untyped_storage()._cdata for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
    alive = {key: nbytes for ref, key, nbytes in created.storages if not ref.expired()}
    return sum(nbytes for key, nbytes in (packed | alive).items() if key not in own), out


_COMPILED: dict[str, tuple] = {}


def _compiled(tmp_path_factory, dtype: str, schedule: str = "1f1b"):
    """The gpt example at pp=2 in ``dtype`` (without recompute): its plan, output directory and block chain."""
    if dtype not in _COMPILED:
        from autopart.driver import compile_plan
        from autopart.codegen.emit import emit_directory

        options = CompileOptions(model=GPT, pp=2, microbatches=4, micro_batch_size=2, schedule=schedule, dtype=dtype)
        plan, front = compile_plan(options)
        out = emit_directory(plan, front.op_graph, front.spec, tmp_path_factory.mktemp(f"gpt-{dtype}") / "out")
        _COMPILED[dtype] = (plan, out, front.chain)
    return _COMPILED[dtype]


def _batch(plan: Plan) -> dict[str, torch.Tensor]:
    """The gpt example's batch of two, by the plan's graph input names."""
    inputs, target = load_model_file(GPT).example(2)
    return dict(zip(plan.graph_inputs, (*inputs, target)))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-autocast"])
def test_bytes_held_for_backward_are_the_predicted_ones(tmp_path_factory, dtype):
    plan, out, chain = _compiled(tmp_path_factory, dtype)
    batch = _batch(plan)
    received: list[torch.Tensor] = []
    for stage in plan.stages:
        module = load_stage(out, stage.index, CPU)
        first, last = stage.blocks
        blocks = chain.blocks[first : last + 1]
        for mode in RECOMPUTE_MODES:
            args = [t.detach().requires_grad_(True) for t in received] + [batch[n] for n in stage.batch_inputs]
            for split in (False, True):
                forward = StageForward(module, recompute=mode, dtype=dtype, device=CPU, split_backward=split)
                measured, result = held_for_backward(forward, args)
                # a whole backward checkpoints each layer by itself, a split one the stage
                layers = [] if split or mode != "full" else checkpointed_layers(chain, first, last, _spans(chain))
                assert forward.layered == bool(layers)
                predicted = recompute_cost(blocks, mode, input_bytes=stage_input_bytes(chain, first, last),
                                           layers=layers)
                assert measured == pytest.approx(predicted.saved_bytes, rel=0.15), (stage.index, mode, split)
        received = [t.detach() for t in result] if isinstance(result, tuple) else []


def _spans(chain) -> list[tuple[int, int]]:
    return [(first, end) for first, end, _ in layer_instances(chain)]


def test_a_stage_reads_the_batch_inputs_its_nodes_reach_and_holds_their_bytes(tmp_path_factory):
    # the plan's stages name the batch inputs they are given, and recompute holds their bytes: one walk for both
    plan, _, chain = _compiled(tmp_path_factory, "fp32")
    by_name = {n.name: n for n in chain.op_graph.fx_nodes()}
    seen = set()
    for stage in plan.stages:
        first, last = stage.blocks
        nodes = [n for b in chain.blocks[first : last + 1] for n in b.nodes]
        read = batch_inputs(chain.op_graph, nodes)
        assert read == batch_inputs(chain.op_graph, nodes, by_name=by_name) and read <= set(plan.graph_inputs)
        assert tuple(stage.batch_inputs) == tuple(n for n in plan.graph_inputs if n in read)
        held = sum(chain.op_graph.nodes[n].output.nbytes for n in read)
        received = chain.boundaries[first - 1].nbytes if first else 0
        assert stage_input_bytes(chain, first, last) == stage_input_bytes(chain, first, last, by_name=by_name) \
            == received + held
        seen |= read
    assert seen == set(plan.graph_inputs)  # token ids to the first stage, targets to the last


def _pinned(plan: Plan, modes: tuple[str, ...], tmp_path: Path) -> Plan:
    """``plan`` compiled again with its cuts pinned and ``modes`` written into its stages."""
    data = plan.to_json()
    for stage, mode in zip(data["stages"], modes):
        stage["recompute"] = mode
    path = tmp_path / f"plan-{'-'.join(modes)}.json"
    path.write_text(json.dumps(data))
    return autopart.compile(GPT, plan=path)


def test_plan_figures_follow_the_recompute_mode(tmp_path_factory, tmp_path):
    from autopart.predict.in_flight import in_flight as _in_flight

    plan, _, chain = _compiled(tmp_path_factory, "fp32")
    plans = {modes: _pinned(plan, modes, tmp_path) for modes in (("full", "selective"), ("selective", "full"),
                                                                  ("stage", "stage"))}
    plans[("none", "none")] = plan
    in_flight = _in_flight("1f1b", 2, 4, 1)  # microbatches each stage holds at its peak: (2, 1)
    for modes, other in plans.items():
        assert tuple(s.recompute for s in other.stages) == modes
        for s, (stage, base) in enumerate(zip(other.stages, plan.stages)):
            first, last = stage.blocks
            layers = checkpointed_layers(chain, first, last, _spans(chain)) if modes[s] == "full" else []
            cost = recompute_cost(chain.blocks[first : last + 1], modes[s], input_bytes=stage_input_bytes(chain, first, last),
                                  layers=layers)
            assert stage.activation_bytes == cost.saved_bytes
            assert stage.backward_s == pytest.approx(base.backward_s + cost.extra_backward_s)
            assert stage.forward_s == base.forward_s and stage.backward_weight_s == base.backward_weight_s
            # the peak adds, once, what a recomputing backward rebuilds while it runs (1F1B: one at a time)
            grown = in_flight[s] * (stage.activation_bytes - base.activation_bytes) + cost.transient_bytes
            assert other.predicted.memory_bytes[s] - plan.predicted.memory_bytes[s] == grown
    for s in range(2):
        by_mode = {p.stages[s].recompute: p.stages[s] for p in plans.values()}
        held = [by_mode[m].activation_bytes for m in ("none", "selective", "full")]
        backward = [by_mode[m].backward_s for m in ("none", "selective", "full")]
        assert held == sorted(held, reverse=True) and backward == sorted(backward)
        # full runs its layers' forward again, not the embedding's or the head's: less than the stage's
        again = by_mode["full"].backward_s - plan.stages[s].backward_s
        assert 0 < again < by_mode["full"].forward_s
        # the stage whole keeps its input alone and runs all of its forward again
        assert by_mode["stage"].activation_bytes < by_mode["full"].activation_bytes
        assert by_mode["stage"].backward_s == pytest.approx(plan.stages[s].backward_s + by_mode["stage"].forward_s)
    assert all(p.predicted.pipeline_s > plan.predicted.pipeline_s for p in plans.values() if p is not plan)


@pytest.mark.parametrize("dtype, listed", [("fp32", "all"), ("bf16", "all"), ("bf16-autocast", "all"),
                                           ("bf16", "first")])
def test_full_recompute_layer_by_layer_computes_what_keeping_computes(tmp_path_factory, monkeypatch, dtype, listed):
    """Under a whole backward full recompute checkpoints each layer method's call by itself: the
    same outputs and gradients as keeping everything, bit for bit (bf16: the layer's recompute
    casts the working weights again), each layer run twice and the rest of the stage once. A
    stage file written before ``layer_calls`` names only its FSDP units' layers
    (``layer_methods``; ``listed="first"``: the others' tensors read elsewhere too): a layer it
    leaves out runs through the same checkpointed method, its working weights found among the stage's."""
    plan, out, _ = _compiled(tmp_path_factory, dtype)
    batch = _batch(plan)
    received: list[torch.Tensor] = []
    for stage in plan.stages:
        module = load_stage(out, stage.index, CPU)
        (method, paths), = type(module).layer_calls.items()
        assert type(module).layer_methods == {method: paths}  # the gpt example's layers read nothing of each other
        if listed == "first":  # the class is shared by the tests
            monkeypatch.delattr(type(module), "layer_calls")
            monkeypatch.setattr(type(module), "layer_methods", {method: paths[:1]})
        calls = []
        body = getattr(module, method)
        setattr(module, method, lambda *a, **k: calls.append(1) or body(*a, **k))
        found = {}
        for mode in ("none", "full"):
            module.zero_grad(set_to_none=True)
            calls.clear()
            args = [t.detach().requires_grad_(True) for t in received] + [batch[n] for n in stage.batch_inputs]
            forward = StageForward(module, recompute=mode, dtype=dtype, device=CPU, split_backward=False)
            assert forward.layered == (mode == "full")
            result, _ = forward(*args)
            outputs = [t for t in result if t.requires_grad] if isinstance(result, tuple) else [result]
            backward_full(outputs, [torch.ones_like(t) for t in outputs], args[: len(received)])
            found[mode] = ([t.detach() for t in outputs], [a.grad for a in args[: len(received)]],
                           {n: p.grad for n, p in module.named_parameters()}, len(calls))
        (out_none, in_none, grads_none, calls_none), (out_full, in_full, grads_full, calls_full) = found.values()
        assert all(torch.equal(a, b) for a, b in zip(out_none, out_full))
        assert all(torch.equal(a, b) for a, b in zip(in_none, in_full))
        assert all(torch.equal(grads_none[n], grads_full[n]) for n in grads_none), stage.index
        assert (calls_none, calls_full) == (len(paths), 2 * len(paths))
        received = [t.detach() for t in result] if isinstance(result, tuple) else []


def test_a_layer_whose_tensors_are_read_elsewhere_is_checkpointed_by_itself_too(tmp_path):
    """The last layer shares its weight with the head, so it is no FSDP unit of its own; full
    recompute still checkpoints its call, and holds what the plan says."""
    from autopart.driver import compile_plan
    from autopart.codegen.emit import emit_directory

    model = REPO / "tests" / "models" / "tied_residual_mlp.py"
    options = CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, stage_layers=(5, 1),
                             recompute="full")
    plan, front = compile_plan(options)
    out = emit_directory(plan, front.op_graph, front.spec, tmp_path / "out")
    module = load_stage(out, 1, CPU)
    assert type(module).layer_calls == {"block": ("layers.5",)} and not hasattr(type(module), "layer_methods")
    forward = StageForward(module, recompute="full", dtype="fp32", device=CPU, split_backward=False)
    assert forward.layered
    first, last = plan.stages[1].blocks
    layers = checkpointed_layers(front.chain, first, last, _spans(front.chain))
    assert len(layers) == 1
    (_, meta), = plan.stages[1].inputs
    received = torch.randn(*meta.shape, requires_grad=True)
    measured, _ = held_for_backward(forward, [received, load_model_file(model).example(2)[1]])
    predicted = recompute_cost(front.chain.blocks[first : last + 1], "full", layers=layers,
                               input_bytes=stage_input_bytes(front.chain, first, last))
    assert measured == pytest.approx(predicted.saved_bytes, rel=0.15)
    assert plan.stages[1].activation_bytes == predicted.saved_bytes


def test_recomputed_activations_live_from_i_to_w():
    assert transient_microbatches(build_schedule("1f1b", ranks=2, microbatches=4), 2) == (1, 1)
    zero_bubble = build_schedule("zb-h1", ranks=4, microbatches=8)
    waits = transient_microbatches(zero_bubble, 4)
    assert all(w >= 1 for w in waits) and max(waits) > 1


def wide_gpt(folder: Path, *, block_size: int, n_embd: int) -> Path:
    """A model file: the gpt example of two layers at that sequence and width, on the meta device."""
    model = folder / "gpt_wide.py"
    model.write_text(textwrap.dedent(f"""
        import sys
        import torch
        sys.path.insert(0, {str(REPO / "examples")!r})
        import gpt

        CONFIG = gpt.GPTConfig(vocab_size=2048, block_size={block_size}, n_layer=2, n_head=16, n_embd={n_embd})

        def build_model():
            with torch.device("meta"):
                return gpt.GPT(CONFIG)

        def example_batch(batch_size):
            tokens = torch.zeros(batch_size, CONFIG.block_size + 1, dtype=torch.long)
            return (tokens[:, :-1],), tokens[:, 1:]

        loss_fn = gpt.loss_fn
    """))
    return model


def test_bf16_runs_faster_on_tensor_cores_and_halves_activations(tmp_path):
    """A GPT layer at sequence 1024 and width 1024 on the meta device, priced for an H100."""
    model = wide_gpt(tmp_path, block_size=1024, n_embd=1024)
    plans = {dtype: autopart.compile(model, micro_batch_size=16, microbatches=1, device="h100-sxm", dtype=dtype)
             for dtype in ("fp32", "bf16")}  # fmt: skip
    fp32, bf16 = plans["fp32"].stages[0], plans["bf16"].stages[0]
    assert bf16.forward_s + bf16.backward_s < 0.2 * (fp32.forward_s + fp32.backward_s)  # 989 vs 67 TFLOP/s
    # Not quite half: the residual stream and the layer norms' inputs stay fp32 under autocast, and
    # the loss's log-softmax runs in fp32; the 16-bit copies of the weights that matmuls save count too.
    assert 0.45 < bf16.activation_bytes / fp32.activation_bytes < 0.7
    assert bf16.parameter_bytes == fp32.parameter_bytes, "the master weights stay fp32"
    assert plans["bf16"].predicted.memory_bytes[0] < plans["fp32"].predicted.memory_bytes[0]
