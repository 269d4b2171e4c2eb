"""Tensor-parallel sharding of a chain solves each (block, pins of its own weights) once, and
gives what solving every block on its own with the chosen pins gives."""

from autopart.passes.annotate import annotate
from autopart.passes.blocks import build_blocks
from autopart.ir.model_file import load_model_file
from autopart.passes.capture import capture
from autopart.passes.rewrite import separate_biases
from autopart.solve import tensor
from cost_models import get_cost_model
from tests.distributed import REPO


def test_each_block_and_pin_is_solved_once_with_the_same_result(monkeypatch):
    spec = load_model_file(REPO / "examples" / "gpt.py")  # tied embedding: a weight two blocks read
    cost_model = get_cost_model("h100-sxm")
    chain = build_blocks(annotate(separate_biases(capture(spec, batch_size=2)), spec, cost_model, micro_batch_size=2))
    calls = []
    solve = tensor._solve_block

    def counted(chain, index, t, cost_model, pinned, nodes, *more):
        own = tuple(sorted((p, pinned[p]) for p in chain.blocks[index].parameters if p in pinned))
        calls.append((index, own))
        return solve(chain, index, t, cost_model, pinned, nodes, *more)

    monkeypatch.setattr(tensor, "_solve_block", counted)
    shardings = tensor.shard_chain(chain, tp=2, cost_model=cost_model)
    assert len(calls) == len(set(calls)), "a block solved twice with the same pins of its weights"
    tied = [k for k, block in enumerate(chain.blocks) if "wte.weight" in block.parameters]
    assert len(tied) == 2
    chosen = shardings[tied[0]].parameters["wte.weight"]
    for k in tied:  # the memoised answer is the block's own with the chosen pin
        alone = solve(chain, k, 2, cost_model, {"wte.weight": chosen}, 1, False)
        assert shardings[k].strategies == alone.strategies and shardings[k].time_s == alone.time_s


GPT_BLOCK = '''
import sys
sys.path.insert(0, {examples!r})
import gpt
gpt.CONFIG = gpt.GPTConfig(vocab_size=1024, block_size=128, n_layer=2, n_head=12, n_embd=768)
build_model, example_batch, loss_fn = gpt.build_model, gpt.example_batch, gpt.loss_fn
'''


def test_solving_the_blocks_side_by_side_gives_what_solving_them_one_by_one_gives(monkeypatch, tmp_path):
    model = tmp_path / "gpt_block.py"  # wide enough that tensor parallelism pays: the Megatron layout
    model.write_text(GPT_BLOCK.format(examples=str(REPO / "examples")))
    spec = load_model_file(model)
    cost_model = get_cost_model("h100-sxm")
    chain = build_blocks(annotate(separate_biases(capture(spec, batch_size=2)), spec, cost_model, micro_batch_size=2))
    found = {}
    for solvers in (1, 4):
        monkeypatch.setattr(tensor, "_SOLVERS", solvers)
        found[solvers] = tensor.shard_chain(chain, tp=4, cost_model=cost_model, sequence_parallel=True)
    assert found[1] == found[4]
    assert any(p.kind == "S" for sharding in found[4] for p in sharding.parameters.values())
