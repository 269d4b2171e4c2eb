"""A forward that updates a buffer of its own in place (a step counter) trains with that update:
torch.fx cannot record it (the op reaches no traced tensor, so it runs once while tracing), and
torch.export records it as an op whose value nothing reads."""

import pytest
import torch

import autopart
from autopart.ir.errors import CaptureError

MODEL = """
import torch
from torch import nn


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(self.fc(x))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Counted(), Counted(), nn.Linear(8, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "counted.py"
    path.write_text(MODEL)
    return path


def test_the_stages_run_the_buffer_updates(tmp_path, model):
    """Each update runs on the stage that holds its buffer: none was on any stage before, the
    counter left as built, in the programs and in every checkpoint, while verify saw nothing."""
    out = tmp_path / "out"
    plan = autopart.compile(model, pp=2, microbatches=2, global_batch_size=4, measure=False)
    assert plan.provenance.capture == "export"  # fx could not record the updates
    autopart.emit(plan, out)
    sources = "".join(p.read_text() for p in sorted((out / "stages").glob("stage_*.py")))
    assert "add_.Tensor(getattr(self, '0').calls, 1)" in sources and "add_.Tensor(getattr(self, '1').calls, 1)" in sources


def test_fx_refuses_an_update_it_cannot_record(model):
    with pytest.raises(CaptureError, match=r"changes its buffer '0.calls' \(and 1 more\) by an op that the capture"):
        autopart.compile(model, pp=2, microbatches=2, global_batch_size=4, capture="fx", measure=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("options", [{"pp": 2, "recompute": "full", "schedule": "1f1b"},
                                     {"pp": 2, "recompute": "selective", "schedule": "zb-h1"},
                                     {"pp": 1, "dp": 2, "schedule": "1f1b"}])
def test_a_counter_advances_once_per_step_whatever_the_microbatches_replicas_and_recompute(tmp_path, options):
    """One process runs one forward per step over the global batch, so its counter advances by one
    per step, where the programs advanced it once per microbatch and again in each recompute (6
    after 3 steps of 2 microbatches, 12 recomputing), and verify's reference once per step."""
    from tests.distributed import assert_same_training, compile_and_train

    path = tmp_path / "counted.py"
    path.write_text(MODEL)
    run = compile_and_train(tmp_path, path, microbatches=2, micro_batch_size=2, steps=3, measure=False, **options)
    counters = {name: value for weights in run.finals.values() for name, value in weights.items()
                if name.endswith("calls")}
    assert counters and all(float(value) == 3.0 for value in counters.values()), counters
    assert_same_training(run, optimizer="sgd", lr=0.1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("options", [{"pp": 2, "recompute": "full", "schedule": "1f1b"},
                                     {"pp": 2, "dp": 2, "recompute": "full", "schedule": "zb-h1"}])
def test_a_loop_over_torch_s_schedules_advances_the_counter_once_per_step(tmp_path, options):
    """`autopart.runtime.pipelining`'s stages, driven by torch's schedules, which run the
    backward and its recompute themselves: the counters advanced once per microbatch and again in
    each recompute (12 after 3 steps of 2 microbatches), on each replica its own."""
    import json
    import re

    from tests.distributed import REPO, run_program

    path = tmp_path / "counted.py"
    path.write_text(MODEL)
    out = tmp_path / "out"
    plan = autopart.compile(path, microbatches=2, micro_batch_size=2, measure=False, **options)
    autopart.emit(plan, out)
    result = run_program([str(REPO / "tests" / "pipelining_buffers_rank.py"), str(out), "3"], plan.world_size)
    printed = [json.loads(line) for line in re.findall(r"^buffers (.*)$", result.stdout, re.MULTILINE)]
    counters = [value for buffers in printed for name, value in buffers.items() if name.endswith("calls")]
    assert len(counters) == 2 * 2 * plan.mesh["dp"] and all(value == 3.0 for value in counters), printed


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, chunks", [("zb-h1", 1), ("zbv", 2)])
def test_a_weight_pass_after_its_stage_s_next_forward_recomputes_nothing_into_the_counter(tmp_path, schedule, chunks):
    """Under full recompute torch's W pass runs the forward again, unseen; what that wrote was
    put back only at the stage's next forward, so a W run after that forward (an order of one's
    own; torch's run each W first) added its recompute to the forward's update: the last stage's
    counter ended at 4.5 after 3 steps. The counters are on every stage (the first recomputes
    nothing in I, having no input gradient to compute)."""
    import json
    import re

    from tests.distributed import REPO, run_program

    path = tmp_path / "counted.py"
    path.write_text(MODEL.replace("Counted(), Counted(), nn.Linear(8, 4)", "Counted(), Counted(), Counted(), Counted()"))
    out = tmp_path / "out"
    # a spec's roofline cuts it alike on every machine (this CPU's, calibrated per session, may cut
    # it so that one rank's stages hold no counter)
    plan = autopart.compile(path, pp=2, chunks=chunks, microbatches=4, micro_batch_size=1, recompute="full",
                            schedule=schedule, measure=False, device="a100-80gb")
    autopart.emit(plan, out)
    result = run_program([str(REPO / "tests" / "pipelining_buffers_rank.py"), str(out), "3",
                          "--weights-after-next-forward"], plan.world_size)
    assert all(int(n) > 0 for n in re.findall(r"^delayed (\d+)$", result.stdout, re.MULTILINE))
    printed = [json.loads(line) for line in re.findall(r"^buffers (.*)$", result.stdout, re.MULTILINE)]
    counters = [value for buffers in printed for name, value in buffers.items() if name.endswith("calls")]
    assert len(counters) == 4 * 2 and all(value == 3.0 for value in counters), printed
    assert all(buffers for buffers in printed), "a counter on every rank"


@pytest.mark.multiprocess
def test_batch_norm_under_torch_s_schedules_ends_as_train_py_leaves_it(tmp_path):
    """torch runs each stage once more to infer its messages' shapes (on the first microbatch,
    and on a later stage on uninitialised tensors) and runs an evaluation with gradients on: the
    running statistics averaged those forwards in with the step's."""
    import json
    import re

    from tests.distributed import REPO, run_program, run_ranks, stage_weights

    path = tmp_path / "bn.py"
    path.write_text(MODEL.replace("Counted(), Counted()", "nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)"))
    out = tmp_path / "out"
    plan = autopart.compile(path, pp=2, microbatches=2, micro_batch_size=2, schedule="gpipe", measure=False)
    autopart.emit(plan, out)
    run_ranks(out, 2, "--steps", "3", "--lr", "0", "--optimizer", "sgd", "--save-weights", str(tmp_path / "final"))
    statistics = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    expected = {name: value for weights in stage_weights(tmp_path / "final").values() for name, value in weights.items()
                if name in statistics}
    result = run_program([str(REPO / "tests" / "pipelining_buffers_rank.py"), str(out), "3", "0"], 2)
    printed = [json.loads(line) for line in re.findall(r"^buffers (.*)$", result.stdout, re.MULTILINE)]
    assert set(expected) == statistics
    for buffers in printed:  # after training, and after the evaluation
        for name in buffers.keys() & expected.keys():
            torch.testing.assert_close(torch.tensor(buffers[name], dtype=expected[name].dtype), expected[name],
                                       msg=name)
    assert sum(len(buffers.keys() & expected.keys()) for buffers in printed) == 2 * len(expected)


@pytest.mark.multiprocess
def test_batch_norm_statistics_are_the_mean_over_the_replicas(tmp_path):
    """Two replicas of one microbatch each normalise by their halves of the batch, as one process
    that sums its gradient over the two halves (the reference's ``microbatches=2``) does; their
    running statistics are the mean of the halves' updates, where each replica kept its own and
    the first one's were saved."""
    from autopart.runtime.reference import train_reference
    from tests.distributed import compile_and_train

    path = tmp_path / "bn.py"
    path.write_text(MODEL.replace("Counted(), Counted()", "nn.Linear(8, 8), nn.BatchNorm1d(8)"))
    run = compile_and_train(tmp_path, path, pp=1, dp=2, microbatches=1, micro_batch_size=4, schedule="1f1b", steps=3,
                            measure=False)
    reference = train_reference(run.out, steps=3, lr=0.1, optimizer="sgd", microbatches=2)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in run.metrics]), torch.tensor(reference.losses))
    finals = {name: value for weights in run.finals.values() for name, value in weights.items()}
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(finals)
    for name, value in finals.items():
        torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=1e-6, msg=name)
    assert int(finals["1.num_batches_tracked"]) == 3


def test_a_buffer_holding_infinities_keeps_them_and_one_starting_at_infinity_moves():
    """A float causal mask (-inf above the diagonal) that no forward changes, and an observer's
    minimum that starts at +inf: a step's mean of their changes made both NaN (-inf minus -inf)."""
    from torch import nn

    from autopart.runtime.buffer_updates import BufferUpdates

    module = nn.Module()
    module.register_buffer("mask", torch.triu(torch.full((3, 3), float("-inf")), diagonal=1))
    module.register_buffer("lowest", torch.full((2,), float("inf")))
    module.register_buffer("calls", torch.zeros((), dtype=torch.int64))
    mask = module.mask.clone()
    updates = BufferUpdates(module)
    for step, lowest in enumerate(([2.0, 3.0], [1.5, 2.5])):  # each microbatch's minimum from the step's, averaged
        for part in (torch.tensor([1.0, 4.0]), torch.tensor([3.0, 2.0])):  # two microbatches
            with updates.forward():
                torch.minimum(module.lowest, part, out=module.lowest)
                module.calls.add_(1)
        updates.finish()
        assert torch.equal(module.mask, mask)
        assert module.lowest.tolist() == lowest and int(module.calls) == step + 1


def test_a_flag_set_beside_the_buffer_it_initialises_is_put_back_with_it():
    """A vector quantiser's pattern: the first forward initialises ``embed`` from its batch and
    sets ``initted``. The flag was not put back with the buffer, so the second microbatch skipped
    the initialisation and the step ended at half the initial value."""
    from torch import nn

    from autopart.runtime.buffer_updates import BufferUpdates

    module = nn.Module()
    module.register_buffer("initted", torch.tensor(False))
    module.register_buffer("embed", torch.zeros(2))
    updates = BufferUpdates(module)
    for part in (torch.tensor([2.0, 4.0]), torch.tensor([4.0, 8.0])):
        with updates.forward():
            if not module.initted:
                module.embed.copy_(part)
                module.initted.fill_(True)
    updates.finish()
    assert bool(module.initted) and module.embed.tolist() == [3.0, 6.0]  # each part's initialisation, averaged


def test_only_the_buffers_the_stage_file_lists_are_tracked():
    """Every buffer was cloned and summed over the first step to find those that moved (a large
    float mask cost three times its bytes, counted by no plan): now a buffer that the stage file
    does not list is left to the forwards, and one it lists, an int8 counter, is summed without
    wrapping."""
    from torch import nn

    from autopart.runtime.buffer_updates import BufferUpdates

    module = nn.Module()
    module.register_buffer("calls", torch.tensor(120, dtype=torch.int8))
    module.register_buffer("unlisted", torch.zeros(()))
    updates = BufferUpdates(module, updated=("calls",))
    for _ in range(4):
        with updates.forward():
            module.calls.add_(1)
            module.unlisted.add_(1)
    updates.finish()
    assert int(module.calls) == 121  # 4 * 121 wraps in int8
    assert float(module.unlisted) == 4.0  # untracked: each forward's write stays


def test_int64_buffers_near_their_ends_take_their_exact_mean():
    """A counter near 2**63 and a sentinel at -2**63 that each forward replaces: their values
    summed over a step's four forwards overflowed int64 (the counter ended at 1), and so did the
    sentinel's changes (it ended at -2**63 + 5). Values that differ between forwards take their
    mean rounded down, negative ones too."""
    from torch import nn

    from autopart.runtime.buffer_updates import BufferUpdates

    module = nn.Module()
    module.register_buffer("seen", torch.tensor([2**62, -2**63, 0, 0], dtype=torch.int64))
    updates = BufferUpdates(module, updated=("seen",))
    for part in range(4):
        with updates.forward():
            module.seen[0] += 1
            module.seen[1:] = torch.tensor([5, part, -part - 1])  # 0..3 has mean 1.5, -1..-4 has -2.5
    updates.finish()
    assert module.seen.tolist() == [2**62 + 1, 5, 1, -3]


MASKED = MODEL.replace('''        self.register_buffer("calls", torch.zeros(()))
''', '''        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mask", torch.zeros(7, 5))  # read, never written: of a shape nothing else has
''').replace("return torch.relu(self.fc(x))", "return torch.relu(self.fc(x)) + self.mask[0, :1]")


def test_a_buffer_that_no_forward_writes_is_never_copied(tmp_path):
    """Training and evaluating copied every buffer (the first step's search by value, and each
    evaluation's putting back): a large float mask cost its bytes again, counted by no plan."""
    from torch.overrides import TorchFunctionMode

    from autopart.runtime.reference import train_reference

    class Copies(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.clone, torch.Tensor.double) and isinstance(args[0], torch.Tensor):
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    assert MASKED != MODEL and "self.mask[0, :1]" in MASKED
    path = tmp_path / "masked.py"
    path.write_text(MASKED)
    plan = autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, measure=False)
    autopart.emit(plan, tmp_path / "out")
    with Copies() as copies:
        run = train_reference(tmp_path / "out", steps=2, lr=0.1, optimizer="sgd", eval_every=1)
    assert run.eval_losses and () in copies.shapes  # the counters are copied
    masks = [name for name, value in run.parameters.items() if value.shape == (7, 5)]
    assert len(masks) == 2 and copies.shapes.count((7, 5)) == len(masks)  # the run's result alone


def test_a_buffer_that_requires_grad_and_holds_no_graph_compiles(tmp_path):
    """A buffer registered as a leaf that requires grad, and only read, trains in the model's own
    loop: the refusal of a buffer that keeps an autograd graph (`check_buffers_hold_no_graph`,
    after the op timing's forward and annotate's) leaves it alone; one built in __init__ from a
    parameter holds a graph from the start and is refused."""
    leaf = MODEL.replace('self.register_buffer("calls", torch.zeros(()))',
                         'self.register_buffer("probe", torch.ones(8, requires_grad=True))').replace(
        "self.calls.add_(1)\n        return torch.relu(self.fc(x))", "return torch.relu(self.fc(x * self.probe))")
    assert "x * self.probe" in leaf
    path = tmp_path / "leaf.py"
    path.write_text(leaf)
    plan = autopart.compile(path, pp=2, microbatches=2, global_batch_size=4)  # measured on this CPU: both checks
    assert plan.mesh["pp"] == 2
    built = leaf.replace("torch.ones(8, requires_grad=True))", "self.fc.weight[0] * 2)")
    path.write_text(built)
    with pytest.raises(autopart.AutopartError, match=r"the model's buffer '0\.probe' \(and 1 more\) holds a value "
                                                     r"computed from trained parameters \(written in forward or in __init__\)"):
        autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, device="a100-80gb")


GATED = MODEL.replace('''        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(self.fc(x))''', '''        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("average", torch.zeros(()))

    def forward(self, x):
        h = self.fc(x)
        # an average that starts moving in the second step: the first step leaves it as it was
        self.average.copy_(torch.where(self.calls > 0, 0.5 * self.average + 0.5 * h.detach().mean(), self.average))
        self.calls.add_(1)
        return torch.relu(h)''')


@pytest.mark.multiprocess
def test_a_buffer_that_first_moves_in_a_later_step_moves_once_a_step(tmp_path):
    """Found by value over the first step, an average that the first step leaves alone was never
    tracked and moved once per microbatch from the second step on; the stage file now says which
    buffers its forward writes, as the capture shows it."""
    from autopart.runtime.buffer_updates import stages_updated_buffers
    from tests.distributed import assert_same_training, compile_and_train

    assert GATED != MODEL
    path = tmp_path / "gated.py"
    path.write_text(GATED)
    run = compile_and_train(tmp_path, path, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", steps=3,
                            measure=False)
    assert set(stages_updated_buffers(run.out)) == {"0.average", "0.calls", "1.average", "1.calls"}
    assert_same_training(run, optimizer="sgd", lr=0.1)  # the averages too: one process moves them once a step


VIEWED = MODEL.replace('''        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(self.fc(x))''', '''        self.register_buffer("state", torch.zeros(3))
        self.register_buffer("features", torch.zeros(8, 2))

    def forward(self, x):
        h = self.fc(x)
        self.state[:1].add_(1)  # a counter in a slice
        self.state.view(-1)[1] = 0.5 * self.state[1] + 0.5 * h.detach().mean()  # an average, set as an item of a view
        self.features[:, 0].copy_(0.9 * self.features[:, 0] + 0.1 * h.detach().mean(0))  # into a column
        return torch.relu(h)''')


@pytest.mark.multiprocess
def test_buffers_updated_through_views_move_once_a_step(tmp_path):
    """Writes through views show in no op's schema as writes to the buffer: the stage files said
    nothing of these, and with only the buffers they list tracked, the counter ended at 6 (once
    per microbatch) and the averages moved twice a step."""
    from autopart.runtime.buffer_updates import stages_updated_buffers
    from tests.distributed import assert_same_training, compile_and_train

    assert VIEWED != MODEL
    path = tmp_path / "viewed.py"
    path.write_text(VIEWED)
    run = compile_and_train(tmp_path, path, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", steps=3,
                            measure=False)
    assert set(stages_updated_buffers(run.out)) == {"0.state", "0.features", "1.state", "1.features"}
    states = [weights[name] for weights in run.finals.values() for name in weights if name.endswith("state")]
    assert len(states) == 2 and all(float(state[0]) == 3.0 for state in states), states
    assert_same_training(run, optimizer="sgd", lr=0.1)


@pytest.mark.multiprocess
def test_a_leaf_module_s_buffers_move_once_a_step(tmp_path):
    """A --leaf BatchNorm's running statistics are written by code the capture does not see: the
    stage file listed none of them (the first step's search by value found them). Each microbatch
    normalises by its own statistics, as one process running the batch in two parts does."""
    from autopart.runtime.buffer_updates import stages_updated_buffers
    from autopart.runtime.reference import train_reference
    from tests.distributed import compile_and_train

    path = tmp_path / "bn.py"
    path.write_text(MODEL.replace("Counted(), Counted()", "nn.Linear(8, 8), nn.BatchNorm1d(8)"))
    run = compile_and_train(tmp_path, path, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", steps=3,
                            measure=False, leaf=("BatchNorm1d",))
    assert set(stages_updated_buffers(run.out)) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    reference = train_reference(run.out, steps=3, lr=0.1, optimizer="sgd", microbatches=2)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in run.metrics]), torch.tensor(reference.losses))
    finals = {name: value for weights in run.finals.values() for name, value in weights.items()}
    for name, value in finals.items():
        torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=1e-6, msg=name)
    assert int(finals["1.num_batches_tracked"]) == 3


ITEM_SET = MODEL.replace('''        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(self.fc(x))''', '''        self.register_buffer("last", torch.zeros(2))

    def forward(self, x):
        h = self.fc(x)
        self.last[0] = h.detach().mean()  # fx records Tensor.__setitem__ on the buffer
        return torch.relu(h)''')


@pytest.mark.multiprocess
def test_an_item_set_in_a_buffer_under_fx_trains_as_one_process(tmp_path):
    """fx records ``self.last[0] = x`` as a ``__setitem__`` call whose value nothing reads, which
    the stages' dead-code pass took for pure and dropped: the buffer never moved."""
    from autopart.runtime.buffer_updates import stages_updated_buffers
    from tests.distributed import assert_same_training, compile_and_train

    assert ITEM_SET != MODEL
    path = tmp_path / "item_set.py"
    path.write_text(ITEM_SET)
    run = compile_and_train(tmp_path, path, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", steps=3,
                            measure=False)
    assert run.plan.provenance.capture == "fx"
    assert set(stages_updated_buffers(run.out)) == {"0.last", "1.last"}
    assert all(float(weights[name][0]) != 0.0 for weights in run.finals.values() for name in weights
               if name.endswith("last"))
    assert_same_training(run, optimizer="sgd", lr=0.1)


READ_BACK = ITEM_SET.replace("self.last[0] = h.detach().mean()  # fx records Tensor.__setitem__ on the buffer",
                             "self.last[0] = 0.5 * self.last[1] + h.detach().mean()  # fx computes the read as it traces\n"
                             "        self.last[1] = h.detach().mean()")


@pytest.mark.multiprocess
def test_a_buffer_read_back_by_its_own_update_trains_as_one_process(tmp_path):
    """fx computes ``0.5 * self.last[1]`` as it traces (no traced value reaches the buffer) and
    kept the result as a constant, so the stages read the value of the capture's time at every
    step; the capture now refuses that fx graph and torch.export captures the read."""
    from autopart.ir.errors import CaptureError
    from tests.distributed import assert_same_training, compile_and_train

    assert READ_BACK != ITEM_SET
    path = tmp_path / "read_back.py"
    path.write_text(READ_BACK)
    with pytest.raises(CaptureError, match=r"reads its buffer '0\.last', which it changes"):
        autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, capture="fx", measure=False)
    run = compile_and_train(tmp_path, path, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", steps=3,
                            measure=False)
    assert run.plan.provenance.capture == "export"
    assert_same_training(run, optimizer="sgd", lr=0.1)


RUNNING_SUM = ITEM_SET.replace("self.last[0] = h.detach().mean()  # fx records Tensor.__setitem__ on the buffer",
                               "self.last[0] = h.detach().mean() + self.last[0]  # fx keeps the read as a view")


@pytest.mark.multiprocess
def test_a_running_sum_read_through_a_view_trains_as_one_process(tmp_path):
    """fx keeps ``self.last[0]`` (no traced value reaches the buffer) as a constant that shares the
    buffer's memory while tracing, so the capture's checks saw the sum advance; the stage files
    load it as a tensor of its own, and the sum read the buffer as built at every step."""
    from tests.distributed import assert_same_training, compile_and_train

    assert RUNNING_SUM != ITEM_SET
    path = tmp_path / "running_sum.py"
    path.write_text(RUNNING_SUM)
    with pytest.raises(CaptureError, match=r"reads its buffer '0\.last', which it changes, through a view"):
        autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, capture="fx", measure=False)
    run = compile_and_train(tmp_path, path, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", steps=3,
                            measure=False)
    assert_same_training(run, optimizer="sgd", lr=0.1)  # the sum over the steps in the saved buffer
    assert run.plan.provenance.capture == "export"
