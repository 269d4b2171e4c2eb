"""A stage holds the buffers its ops read, and the memory model counts them
(`autopart.predict.memory.held_buffer_bytes`): a nanoGPT-style causal mask in every attention
layer is counted on the stage of each layer, in the plan's figures and in the search's and the
cut solver's memory limits; a buffer that the forward updates costs its runtime copies too."""

import itertools
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import autopart
from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.tensors import tensor_meta
from autopart.passes import blocks
from autopart.predict import memory
from autopart.predict.memory import held_buffer_bytes
from autopart.runtime.buffer_updates import BufferUpdates, stages_updated_buffers
from autopart.runtime.stage import stage_names
from autopart.solve.chain_costs import chain_sums
from autopart.solve.pipeline import PipelineProblem, evaluate, solve_cuts
from tests.distributed import run_cli_here
from tests.synthetic_chains import random_table

LAYERS, SEQ = 4, 8
BLOCK = 1024  # the mask's side: 4 MiB of fp32 per layer, beside well under 1 MiB of weights
MASK_BYTES = BLOCK * BLOCK * 4
MIB = 1 << 20

MASKED = """
import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, LAYERS, BLOCK, SEQ = 32, 8, {layers}, {block}, {seq}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, BLOCK, BLOCK))

    def forward(self, x):
        T = x.size(1)
        q, k, v = self.qkv(x).split(WIDTH, dim=2)
        att = (q @ k.transpose(-2, -1)) * WIDTH ** -0.5
        att = att.masked_fill(self.bias[:, :T, :T] == 0, float("-inf"))
        return self.proj(F.softmax(att, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(WIDTH), Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        # after the attention, no mask: {tail} wide linears, or none
        self.tail = nn.Sequential(*(m for k in range({tail}) for m in (nn.Linear(WIDTH, 1024 + k), nn.GELU(),
                                                                      nn.Linear(1024 + k, WIDTH))))

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.tail(x))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),), torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
"""

UPDATED = """
import torch
from torch import nn


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros({elements}))
        self.register_buffer("seen_half", torch.zeros({elements}, dtype=torch.bfloat16))

    def forward(self, x):
        self.seen.add_(1)
        self.seen_half.add_(1)
        return torch.relu(self.fc(x))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Counted(), nn.Linear(8, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))  # a front cached by another test keeps its figures


def _model(tmp_path: Path, block: int = BLOCK, tail: int = 0) -> Path:
    path = tmp_path / f"masked_{block}_{tail}.py"
    path.write_text(MASKED.format(layers=LAYERS, block=block, seq=SEQ, tail=tail))
    return path


def test_each_stage_s_memory_counts_the_masks_of_the_layers_it_holds(tmp_path, monkeypatch):
    options = CompileOptions(model=_model(tmp_path), pp=2, microbatches=2, micro_batch_size=1, measure=False,
                             time_limit_s=5)
    plan, _ = compile_to_directory(options, tmp_path / "out")
    monkeypatch.setattr(blocks, "held_buffer_bytes", lambda buffer, updated: 0)
    unbuffered, _ = compile_to_directory(options, tmp_path / "unbuffered")
    assert [s.blocks for s in plan.stages] == [s.blocks for s in unbuffered.stages]
    for stage in plan.stages:  # the masks its program holds: those of the layers whose attention it runs
        held = set(stage_names(tmp_path / "out", stage.index)) - set(stage.parameters)
        assert held == {f"{name.rsplit('.', 3)[0]}.attn.bias" for name in stage.parameters
                        if name.endswith("attn.qkv.weight")} and held
        more = plan.predicted.memory_bytes[stage.rank] - unbuffered.predicted.memory_bytes[stage.rank]
        assert more == len(held) * MASK_BYTES


@pytest.mark.parametrize("layout", [dict(pp=2, microbatches=4, schedule="1f1b"), dict(world_size=2)],
                         ids=["cut solver", "search"])
def test_a_memory_limit_only_the_masks_break_moves_the_cut_off_the_masked_layers(tmp_path, layout):
    """Four masked attention layers, then wide linears that take most of the time: the
    time-balanced cut of two stages puts three masks or four on the first rank. Under a limit two
    and a half masks above what the model holds with masks of a few bytes, the cut solver and the
    search each move the cut so that no rank holds more than two."""
    options = dict(global_batch_size=4, measure=False, run_finalists=False, time_limit_s=5, **layout)
    small = autopart.compile(_model(tmp_path, block=SEQ, tail=2), **options)
    assert max(_masked_layers(small)) >= 3  # the cut where memory does not bind
    limit = max(small.predicted.memory_bytes) + 2 * MASK_BYTES + MASK_BYTES // 2
    plan = autopart.compile(_model(tmp_path, tail=2), memory_gib=limit / (1 << 30), **options)
    assert max(_masked_layers(plan)) <= 2 and max(plan.predicted.memory_bytes) <= limit


def _masked_layers(plan) -> list[int]:
    """Per rank, the masked layers its stages hold."""
    held = [0] * plan.mesh["pp"]
    for stage in plan.stages:
        held[stage.rank] += sum(name.endswith("attn.qkv.weight") for name in stage.parameters)
    return held


def test_a_pinned_layout_that_the_masks_overfill_is_refused_in_one_line(tmp_path):
    small = autopart.compile(_model(tmp_path, block=SEQ), pp=1, global_batch_size=4, microbatches=1, measure=False,
                             time_limit_s=5)
    limit = max(small.predicted.memory_bytes) + 2 * MASK_BYTES  # half the masks
    result = run_cli_here("compile", str(_model(tmp_path)), "-o", str(tmp_path / "out"), "--pp", "1",
                          "--global-batch-size", "4", "--microbatches", "1", "--memory", f"{limit / (1 << 30):.6f}",
                          "--no-measure", "--time-limit", "5", "--capture", "export")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopart: error: the model does not fit"), lines


@pytest.mark.parametrize("dtype, extra", [(torch.float32, 2), (torch.bfloat16, 3), (torch.float64, 2),
                                          (torch.int8, 17), (torch.int64, 3), (torch.bool, 9)])
def test_an_updated_buffer_costs_what_the_runtime_keeps_of_it_through_a_step(dtype, extra):
    module = nn.Module()
    module.register_buffer("counter", torch.zeros(1000, dtype=dtype))
    updates = BufferUpdates(module, updated=("counter",))
    for _ in range(3):  # microbatches: the start copy and the sums live from the first to the step's end
        with updates.forward():
            module.counter.data.copy_(torch.ones_like(module.counter))
    with updates.forward():
        pass
    kept = sum(t.nbytes for t in (*updates.start.values(), *updates.sums.values()))
    meta = tensor_meta(module.counter)
    assert held_buffer_bytes(meta, updated=True) == meta.nbytes + kept == (1 + extra) * meta.nbytes
    assert held_buffer_bytes(meta, updated=False) == meta.nbytes


def test_the_plan_counts_an_updated_buffer_s_copies(tmp_path, monkeypatch):
    elements = 1 << 16
    path = tmp_path / "counted.py"
    path.write_text(UPDATED.format(elements=elements))
    options = CompileOptions(model=path, pp=1, microbatches=2, global_batch_size=4, measure=False, time_limit_s=5)
    plan, _ = compile_to_directory(options, tmp_path / "out")
    assert set(stages_updated_buffers(tmp_path / "out")) == {"0.seen", "0.seen_half"}
    monkeypatch.setattr(blocks, "held_buffer_bytes", lambda buffer, updated: memory.held_buffer_bytes(buffer, updated=False))
    untracked, _ = compile_to_directory(options, tmp_path / "untracked")
    fp32, bf16 = 4 * elements, 2 * elements
    # a start copy of each, and the sums: fp32's in fp32, bf16's in fp32
    assert plan.predicted.memory_bytes[0] - untracked.predicted.memory_bytes[0] == 2 * fp32 + (bf16 + 2 * bf16)


def _buffer_reads(blocks: int) -> tuple[list[tuple[str, ...]], dict[str, int]]:
    """Per block the buffers it reads: rotary tables that every block but the first and last
    reads, and a mask of its own in every other block; and each buffer's held bytes."""
    reads = [(("rope",) if 0 < k < blocks - 1 else ()) + ((f"mask{k}",) if k % 2 else ()) for k in range(blocks)]
    held = {"rope": 3 * MIB, **{f"mask{k}": (k + 1) * MIB for k in range(1, blocks, 2)}}
    return reads, held


def _stage_buffers(reads: list[tuple[str, ...]], held: dict[str, int], first: int, last: int) -> int:
    return sum(held[name] for name in {name for k in range(first, last + 1) for name in reads[k]})


def test_the_search_s_cutter_holds_each_stage_s_buffers_a_shared_one_in_every_stage_that_reads_it():
    costs = random_table(random.Random(3), layers=3).chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    reads, held = _buffer_reads(len(costs))
    buffered = costs.changed(buffer_bytes=held, block_buffers=tuple(reads))
    adam = lambda size, **kind: 4 * size  # noqa: E731 - a layout's state, as the search sets it
    for plain, with_buffers in ((costs, buffered), (costs.with_state(adam), buffered.with_state(adam))):
        plain_sums, buffered_sums = chain_sums(plain), chain_sums(with_buffers)
        for first, last in itertools.combinations_with_replacement(range(len(costs)), 2):
            more = buffered_sums.parameters(first, last) - plain_sums.parameters(first, last)
            assert more == _stage_buffers(reads, held, first, last), (first, last)
    assert buffered.state_bytes_total(adam) - costs.state_bytes_total(adam) == sum(held.values())


def test_the_cut_problem_holds_each_stage_s_buffers_and_cp_sat_keeps_them_under_the_limit():
    rng = random.Random(5)
    blocks, stages = 8, 3
    reads, held = _buffer_reads(blocks)
    fields = dict(block_time_s=tuple(rng.uniform(1e-4, 5e-3) for _ in range(blocks)),
                  block_activation_bytes=(1000,) * blocks, boundary_transfer_s=(1e-5,) * (blocks - 1),
                  parameter_state_bytes={f"p{k}": 1000 for k in range(blocks)},
                  block_parameters=tuple((f"p{k}",) for k in range(blocks)), stages=stages, microbatches=4,
                  in_flight=(3, 2, 1), memory_limit_bytes=1 << 40)
    plain, buffered = PipelineProblem(**fields), PipelineProblem(**fields, buffer_bytes=held, block_buffers=tuple(reads))
    all_cuts = list(itertools.combinations(range(blocks - 1), stages - 1))
    for cuts in all_cuts:
        ranges = list(zip((0, *(c + 1 for c in cuts)), (*cuts, blocks - 1)))
        more = [a - b for a, b in zip(evaluate(buffered, cuts).rank_memory_bytes, evaluate(plain, cuts).rank_memory_bytes)]
        assert more == [_stage_buffers(reads, held, first, last) for first, last in ranges]
    fastest = solve_cuts(buffered, time_limit_s=20).evaluation
    limit = max(fastest.rank_memory_bytes) - 1  # the buffers alone make the fastest cuts too large
    limited = PipelineProblem(**{**fields, "memory_limit_bytes": limit}, buffer_bytes=held, block_buffers=tuple(reads))
    fitting = [evaluate(limited, cuts) for cuts in all_cuts if max(evaluate(limited, cuts).rank_memory_bytes) <= limit]
    solution = solve_cuts(limited, time_limit_s=20)
    assert max(solution.evaluation.rank_memory_bytes) <= limit
    assert solution.evaluation.objective_s == pytest.approx(min(e.objective_s for e in fitting), rel=1e-6)
