"""Which buffers a forward writes, found in the captured graph: a write through a view of a buffer
(``self.buf[:, 0].add_(1)``) shows in no op's schema as a write to the buffer, and a buffer the
stage file leaves out moves once per microbatch (`autopart.runtime.buffer_updates`)."""

import operator

import pytest
import torch
from torch import fx, nn

import autopart
from autopart.passes.buffer_writes import written_attributes, written_in_forward

VIEWS = """
import torch
from torch import nn


class Viewed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        for name, shape in [("grid", (3, 4)), ("flat", (2, 3)), ("tail", (10,)), ("cols", (4, 3)),
                            ("narrowed", (5,)), ("wide", (2, 8)), ("strided", (6,)), ("halves", (4, 2)),
                            ("permuted", (2, 3, 4)), ("read", (4,))]:
            self.register_buffer(name, torch.zeros(shape))

    def forward(self, x):
        h = self.fc(x)
        m = h.detach().mean()
        self.grid[:, 0].add_(1)                                    # slice, select, in-place arithmetic
        self.flat.view(-1)[0] = m                                  # view, setitem
        self.tail[2:].copy_(h.detach().mean(0))                    # slice, copy_
        self.cols.t().index_put_((torch.tensor([1]),), m.expand(1, 4))  # t, index_put_
        self.narrowed.narrow(0, 1, 2).fill_(3)                     # narrow, fill_
        self.wide.unsqueeze(0).transpose(1, 2).reshape(8, 2)[:, 1].mul_(0.5)  # unsqueeze, transpose, reshape
        self.strided.as_strided((2,), (3,)).zero_()                # as_strided, zero_
        self.halves.chunk(2)[1].squeeze(0).sub_(m)                 # chunk, getitem, squeeze
        self.permuted.permute(2, 0, 1).flatten(1)[0].clamp_(max=m) # permute, flatten
        return torch.relu(h) + self.read.t().sum() + self.read[1:].clone().add_(1).sum()  # read, or a copy written


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Viewed(), nn.Linear(8, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""

WRITTEN = {f"0.{name}" for name in ("grid", "flat", "tail", "cols", "narrowed", "wide", "strided", "halves", "permuted")}


def test_a_write_through_any_view_of_a_buffer_is_in_the_stage_file(tmp_path):
    """torch.export captures each write as an op on a view (``aten.add_(aten.select(grid))``): the
    stage file said its forward updated none of these buffers."""
    from autopart.runtime.buffer_updates import stages_updated_buffers

    path = tmp_path / "views.py"
    path.write_text(VIEWS)
    plan = autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, measure=False)
    assert plan.provenance.capture == "export"
    autopart.emit(plan, tmp_path / "out")
    assert set(stages_updated_buffers(tmp_path / "out")) == WRITTEN  # '0.read' only read, or copied first


class _BufferTracer(fx.Tracer):
    """fx with buffers as graph values, so that their views are method and function calls."""
    proxy_buffer_attributes = True


@fx.wrap
def _opaque_update(buffer, value):
    buffer.add_(value)
    return value


class _FxViews(nn.Module):
    def __init__(self):
        super().__init__()
        for name in ("selected", "narrowed", "out", "relu", "method", "wrapped", "read", "cloned", "transposed"):
            self.register_buffer(name, torch.zeros(4, 4))

    def forward(self, x):
        torch.select(self.selected, 0, 1).add_(x.sum())             # a torch function's view
        torch.narrow(self.narrowed, 1, 0, 2).copy_(x[:4, :2])
        torch.add(x[:4], 1, out=self.out.view(4, 4))               # out=
        nn.functional.relu(self.relu.expand(2, 4, 4)[0], inplace=True)
        self.method.view(16).masked_fill_(x[0].repeat(2) > 0, 1.0)
        y = _opaque_update(self.wrapped[0], x.sum())                # the user's function, kept whole
        z = self.cloned.clone()
        z.add_(1)
        self.transposed.T[0].add_(x.sum())                          # an attribute that is a view
        return x + y + self.read.t()[0] + z.sum()


def test_fx_views_of_buffers_are_followed_and_an_opaque_function_taken_to_write():
    graph = _BufferTracer().trace(_FxViews())
    assert any(n.op == "call_method" and n.target == "view" for n in graph.nodes)  # the views are in the graph
    assert written_attributes(graph) == {"selected", "narrowed", "out", "relu", "method", "wrapped", "transposed"}


@pytest.mark.parametrize("write", ["add_", "copy_"])
def test_an_in_place_op_s_result_is_the_buffer_it_wrote(write):
    """``y = buf.add_(1); y[0].zero_()`` writes ``buf`` twice: the in-place op returns it."""
    graph = fx.Graph()
    buffer = graph.get_attr("counter")
    result = graph.call_method(write, (buffer, graph.placeholder("x")))
    graph.call_method("zero_", (graph.call_function(operator.getitem, (result, 0)),))
    graph.output(None)
    assert written_attributes(graph) == {"counter"}


@pytest.mark.parametrize("op, target", [("call_function", operator.setitem), ("call_method", "__setitem__")])
def test_an_item_set_in_a_view_writes_the_buffer(op, target):
    """``buf.view(-1)[0] = x`` as fx records it when it can (a proxy cannot take item assignment)."""
    graph = fx.Graph()
    view = graph.call_method("view", (graph.get_attr("flat"), -1))
    graph.create_node(op, target, (view, 0, graph.placeholder("x")))
    graph.output(None)
    assert written_attributes(graph) == {"flat"}


def test_values_made_in_forward_and_written_are_found_with_their_views():
    """``z = zeros_like(x); z[0].add_(w); y = z * 2``: a stage that made ``z`` again from the batch
    would read it unwritten, so it and its views are found; an input, a buffer and the values made
    from them are the runtime's, and a product of the written value is a value of its own."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    made = graph.call_function(torch.zeros_like, (x,))
    row = graph.call_function(operator.getitem, (made, 0))
    written = graph.call_method("add_", (row, graph.get_attr("weight")))
    product = graph.call_function(operator.mul, (made, 2))
    graph.call_method("add_", (graph.call_method("view", (x, -1)), 1))  # the input's own
    graph.call_method("add_", (graph.call_function(operator.getitem, (graph.get_attr("counter"), 0)), 1))
    untouched = graph.call_function(torch.ones_like, (x,))
    graph.output((product, untouched))
    assert written_in_forward(graph) == {made.name, row.name, written.name}


EAGER_VIEWS = VIEWS.replace("""        self.grid[:, 0].add_(1)                                    # slice, select, in-place arithmetic
""", "").replace(""".fill_(3)""", ".fill_(m)").replace(""".mul_(0.5)""", ".mul_(m)").replace("""
        self.strided.as_strided((2,), (3,)).zero_()                # as_strided, zero_
        self.halves.chunk(2)[1].squeeze(0).sub_(m)                 # chunk, getitem, squeeze
        self.permuted.permute(2, 0, 1).flatten(1)[0].clamp_(max=m) # permute, flatten""", "")
EAGER_WRITTEN = {"0.flat", "0.tail", "0.cols", "0.narrowed", "0.wide"}


def test_a_view_that_fx_keeps_as_a_copy_is_captured_by_export(tmp_path):
    """fx computes ``self.tail[2:]`` as it traces (no traced value reaches the buffer) and keeps the
    view as a constant that shares the buffer's memory while tracing, so the capture's check saw the
    buffer move; the stage files loaded the constant as a tensor of its own, wrote it and never the
    buffer, and listed no buffer as updated."""
    from autopart.ir.errors import CaptureError
    from autopart.runtime.buffer_updates import stages_updated_buffers

    assert EAGER_VIEWS.count("\n") == VIEWS.count("\n") - 4
    path = tmp_path / "eager_views.py"
    path.write_text(EAGER_VIEWS)
    with pytest.raises(CaptureError, match=r"writes its buffer '0\.\w+' through a view that torch.fx keeps as a copy"):
        autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, capture="fx", measure=False)
    plan = autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, measure=False)
    assert plan.provenance.capture == "export"
    autopart.emit(plan, tmp_path / "out")
    assert set(stages_updated_buffers(tmp_path / "out")) == EAGER_WRITTEN


FORMS = """
import torch
from torch import nn


class Written(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("buf", torch.zeros(10))

    def reset_parameters(self):  # what makes the buffer's values when the model is built on the meta device
        self.buf.zero_()

    def forward(self, x):
        h = self.fc(x)
        WRITE
        return torch.relu(h)


def build_model():
    with torch.device(DEVICE):
        return nn.Sequential(Written(), nn.Linear(8, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""

WRITES = {  # how fx loses the write, and the refusal that says so
    "counter": ("self.buf.add_(1)", r"changes its buffer '0\.buf' by an op that the capture cannot record"),
    "view": ("self.buf[2:].copy_(h.detach().mean(0))",
             r"writes its buffer '0\.buf' through a view that torch.fx keeps as a copy"),
    "read": ("self.buf[0] = h.detach().mean() + self.buf[0]",
             r"reads its buffer '0\.buf', which it changes, through a view that torch.fx keeps as a copy"),
    "computed": ("self.buf[0] = 0.5 * self.buf[1] + h.detach().mean()",
                 r"computes _tensor_constant\d+ as it traces, from the model's tensors on the meta device"),
}


@pytest.mark.parametrize("device, write", [("meta", "counter"), ("meta", "view"), ("meta", "read"), ("meta", "computed"),
                                           ("cpu", "read")])
def test_a_write_fx_loses_is_refused_under_fx_and_captured_by_export(tmp_path, device, write):
    """fx runs ``self.buf.add_(1)`` once while tracing, and keeps ``self.buf[2:]`` or ``self.buf[0]``
    as a constant that shares the buffer's memory while tracing but is loaded by the stage files as
    a tensor of its own: the write is lost, or the update reads the buffer as built at every step.
    A read was refused on no device, and nothing on the meta device, where the check compared
    storage addresses (none there) and ran no forward to compare; a value fx computes from a meta
    buffer (``0.5 * self.buf[1]``) has no values for the stage files to load."""
    from autopart.ir.errors import CaptureError
    from autopart.runtime.buffer_updates import stages_updated_buffers

    code, refusal = WRITES[write]
    path = tmp_path / f"{write}_{device}.py"
    path.write_text(FORMS.replace("WRITE", code).replace("DEVICE", repr(device)))
    with pytest.raises(CaptureError, match=refusal) as refused:
        autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, capture="fx", measure=False)
    assert str(refused.value).endswith("; use --capture export"), "the model has no control flow to rewrite"
    plan = autopart.compile(path, pp=2, microbatches=2, global_batch_size=4, measure=False)
    assert plan.provenance.capture == "export"
    autopart.emit(plan, tmp_path / "out")
    assert set(stages_updated_buffers(tmp_path / "out")) == {"0.buf"}


def test_a_meta_model_s_leaf_module_writes_its_own_buffers(tmp_path):
    """On the meta device the capture tells the buffers a forward wrote by their version counters,
    and the graph's writes by its ops: a --leaf BatchNorm's call is the op that writes its statistics."""
    from autopart.ir.model_file import load_model_file
    from autopart.passes.capture import capture

    path = tmp_path / "leaf_norm.py"
    path.write_text(FORMS.replace("WRITE", "h = self.norm(h)").replace("DEVICE", "'meta'").replace(
        'self.register_buffer("buf", torch.zeros(10))', 'self.register_buffer("buf", torch.zeros(10))\n'
        '        self.norm = nn.BatchNorm1d(8)'))
    graph = capture(load_model_file(path), batch_size=2, leaves=("BatchNorm1d",))
    assert graph.method == "fx"
    assert [str(n.target) for n in graph.module.graph.nodes if n.op == "call_module"] == ["0.norm"]
