"""Annotations at many micro-batch sizes read off the line through two real ones
(autopart/passes/scale.py): equal to real annotations where every figure is affine in the size,
and never trusted where one is not."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autopart.options import CompileOptions
from autopart.passes.scale import affine_op_graph, lines_agree
from autopart.solve import front_table
from autopart.solve.front_table import FrontTable
from tests.distributed import REPO


def _table(model: Path, device: str, dtype: str) -> FrontTable:
    return FrontTable(CompileOptions(model=model, device=device, dtype=dtype, costs=None))


def _count_real_annotations(monkeypatch) -> list[int]:
    """The micro-batch sizes the planner's tables annotate for real from now on, in order."""
    calls: list[int] = []
    real = front_table.annotated

    def counted(options, size, **how):
        calls.append(size)
        return real(options, size, **how)

    monkeypatch.setattr(front_table, "annotated", counted)
    return calls


@pytest.mark.parametrize("model, dtype, tp", [("examples/gpt.py", "bf16", 2), ("examples/llama.py", "fp32", 1),
                                              ("examples/gpt.py", "bf16-autocast", 1)])
def test_a_transformer_s_annotation_lies_on_the_line_through_two_sizes(model, dtype, tp) -> None:
    table = _table(REPO / model, "h100-sxm", dtype)
    real = {b: table.annotated_front(micro_batch_size=b, tp=tp, dtype=dtype) for b in (2, 3)}
    fresh = _table(REPO / model, "h100-sxm", dtype)  # no lines: every size annotated for real
    fresh._lines.front = lambda size, form, annotate: annotate(size)
    for size in (4, 8):
        line = affine_op_graph(real[2].op_graph, real[3].op_graph, size, real[2].cost_model)
        truth = fresh.annotated_front(micro_batch_size=size, tp=tp, dtype=dtype).op_graph
        assert line is not None and lines_agree(line, truth)


def test_the_table_annotates_three_sizes_and_reads_the_rest_off_the_checked_line(monkeypatch) -> None:
    table = _table(REPO / "examples" / "gpt.py", "h100-sxm", "bf16")
    calls = _count_real_annotations(monkeypatch)
    fronts = {b: table.annotated_front(micro_batch_size=b, tp=2, dtype="bf16") for b in (1, 2, 4, 8, 3, 16)}
    assert calls == [1, 2, 4, 8]  # 1 is its own (its reshapes are views), 2 and 4 the line, 8 its check
    fresh = _table(REPO / "examples" / "gpt.py", "h100-sxm", "bf16")
    fresh._lines.front = lambda size, form, annotate: annotate(size)
    for b in (3, 16):
        truth = fresh.annotated_front(micro_batch_size=b, tp=2, dtype="bf16")
        assert lines_agree(fronts[b].op_graph, truth.op_graph)
        assert [k.forward_s for k in fronts[b].chain.blocks] == pytest.approx([k.forward_s for k in truth.chain.blocks],
                                                                              rel=1e-12)


_SIMILARITY = """
    import torch
    from torch import nn

    class Model(nn.Module):  # a contrastive head: a batch x batch matrix, quadratic in the batch
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            z = self.proj(x)
            return z @ z.t()

    def build_model():
        return Model()

    def example_batch(batch_size):
        return (torch.ones(batch_size, 8),), torch.arange(batch_size)

    def loss_fn(scores, targets):
        return nn.functional.cross_entropy(scores, targets)
"""


def test_a_figure_off_the_line_is_caught_and_every_size_annotated_for_real(tmp_path, monkeypatch) -> None:
    model = tmp_path / "similarity.py"
    model.write_text(textwrap.dedent(_SIMILARITY))
    table = _table(model, "h100-sxm", "fp32")
    calls = _count_real_annotations(monkeypatch)
    for b in (2, 3, 4, 8):
        table.annotated_front(micro_batch_size=b, tp=1, dtype="fp32")
    assert calls == [2, 3, 4, 8]  # the check at 4 failed: 8 is annotated too
    fronts = table._lines._real[(False, "fp32")]
    line = affine_op_graph(fronts[2].op_graph, fronts[3].op_graph, 8, fronts[2].cost_model)
    assert line is not None and not lines_agree(line, fronts[8].op_graph)  # the line would have been wrong


def test_the_line_is_read_at_most_twice_as_far_as_it_was_checked(monkeypatch) -> None:
    shown: list[str] = []
    table = FrontTable(CompileOptions(model=REPO / "examples" / "llama.py", device="h100-sxm", dtype="fp32", costs=None),
                       progress=lambda what, done, total: shown.append(what))
    calls = _count_real_annotations(monkeypatch)
    for b in (2, 3, 4, 8, 16, 12, 6):
        table.annotated_front(micro_batch_size=b, tp=1, dtype="fp32")
    assert calls == [2, 3, 4, 16]  # 4 checks the line; 8 is read; 16, beyond 2 x 4, is checked; 12 and 6 read
    assert shown == [f"capturing at micro-batch size {b}" for b in calls]  # a size read off the line is not captured


def test_told_the_largest_size_the_line_is_checked_there_once_for_every_size(monkeypatch) -> None:
    table = FrontTable(CompileOptions(model=REPO / "examples" / "llama.py", device="h100-sxm", dtype="fp32", costs=None),
                       largest_size=16)
    calls = _count_real_annotations(monkeypatch)
    fronts = {b: table.annotated_front(micro_batch_size=b, tp=1, dtype="fp32") for b in (1, 2, 3, 4, 8, 12, 16)}
    assert calls == [1, 2, 3, 16]  # 4 asks for the line's check: made at 16, it covers 8 and 12 too
    assert fronts[16] is table._lines._real[(False, "fp32")][16]  # a size annotated for real is given as it is
    fresh = _table(REPO / "examples" / "llama.py", "h100-sxm", "fp32")
    fresh._lines.front = lambda size, form, annotate: annotate(size)
    for b in (4, 12):
        assert lines_agree(fronts[b].op_graph, fresh.annotated_front(micro_batch_size=b, tp=1, dtype="fp32").op_graph)


def test_told_the_largest_size_a_line_that_fails_there_is_not_used(tmp_path, monkeypatch) -> None:
    model = tmp_path / "similarity.py"
    model.write_text(textwrap.dedent(_SIMILARITY))
    table = FrontTable(CompileOptions(model=model, device="h100-sxm", dtype="fp32", costs=None), largest_size=8)
    calls = _count_real_annotations(monkeypatch)
    for b in (2, 3, 4, 6, 8):
        table.annotated_front(micro_batch_size=b, tp=1, dtype="fp32")
    assert calls == [2, 3, 8, 4, 6]  # the check at 8 failed: 4 and 6 annotated for real, 8 given as made
    assert table._lines._lines[(False, "fp32")] is None
