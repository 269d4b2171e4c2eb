"""The torchrun command told for a plan (`autopart.runtime.torchrun_command`): one node, nodes of
one size (one command for all, c10d rendezvous), and nodes of unequal size (each node its own
``--nproc-per-node`` and ``--node-rank``, so that the full nodes hold the first ranks)."""

import json

import pytest

from autopart.ir.plan import Plan
from autopart.runtime.torchrun_command import Launch, node_sizes
from tests.distributed import REPO

RENDEZVOUS = "--rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id autopart"
STATIC = "--master-addr HOST --master-port 29500"


@pytest.mark.parametrize("world_size, gpus_per_node, sizes", [
    (2, 8, (2,)), (8, 8, (8,)), (4, 2, (2, 2)), (6, 4, (4, 2)), (10, 4, (4, 4, 2)), (3, 2, (2, 1)), (5, None, (5,)),
])
def test_ranks_fill_the_nodes_in_order(world_size, gpus_per_node, sizes):
    assert node_sizes(world_size, gpus_per_node) == sizes


@pytest.mark.parametrize("sizes, line", [
    ((2,), "torchrun --nproc-per-node 2 T --steps 3"),
    ((2, 2), f"torchrun --nnodes 2 --nproc-per-node 2 {RENDEZVOUS} T --steps 3 on each of the 2 nodes (HOST: the first "
             "node's address)"),
    ((4, 2), f"on node 0: torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 {STATIC} T --steps 3; on node 1: "
             f"torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 {STATIC} T --steps 3 (HOST: the first node's address)"),
    ((4, 4, 2), f"on nodes 0 to 1 (R: the node's number): torchrun --nnodes 3 --node-rank R --nproc-per-node 4 {STATIC} "
                f"T --steps 3; on node 2: torchrun --nnodes 3 --node-rank 2 --nproc-per-node 2 {STATIC} T --steps 3 "
                "(HOST: the first node's address)"),
])
def test_the_command_on_one_line(sizes, line):
    assert Launch(train="T", sizes=sizes, args="--steps 3").one_line() == line


def test_the_commands_one_per_line_after_a_heading():
    assert Launch(train="T", sizes=(2,)).block() == ":\n  torchrun --nproc-per-node 2 T"
    assert Launch(train="T", sizes=(1, 1)).block("    ", gap=True) == (
        f", on each of the 2 nodes (HOST: the first node's address):\n\n    torchrun --nnodes 2 --nproc-per-node 1 "
        f"{RENDEZVOUS} T")
    assert Launch(train="T", sizes=(2, 1)).block() == (
        f", on 2 nodes (HOST: the first node's address):\n  on node 0: torchrun --nnodes 2 --node-rank 0 "
        f"--nproc-per-node 2 {STATIC} T\n  on node 1: torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 {STATIC} T")


def test_a_plan_records_its_nodes_and_an_older_one_reads_as_none():
    data = json.loads((REPO / "tests" / "golden" / "gpt" / "plan.json").read_text())
    data["predicted"].update(error_median=None, error_worst=None, error_benchmark="")  # the golden file's stand-ins
    data["provenance"].update(bound_s=0.0, gap=0.0, autopart_version="0", torch_version="0")
    assert Plan.from_json(data).gpus_per_node == data["gpus_per_node"] == 8
    del data["gpus_per_node"]
    assert Plan.from_json(data).gpus_per_node is None


def test_a_plan_given_with_plan_keeps_its_nodes(tmp_path):
    """``--plan`` rebuilt a plan for 2-device nodes with the compile's --gpus-per-node (8): its
    stages placed as on one node, and its launch told as 'torchrun --nproc-per-node 4'."""
    from autopart.driver import CompileOptions, compile_to_directory

    options = dict(model=REPO / "examples" / "gpt.py", measure=False)
    first, _ = compile_to_directory(CompileOptions(**options, pp=2, dp=2, microbatches=2, gpus_per_node=2),
                                    tmp_path / "a")  # fmt: skip
    pinned, _ = compile_to_directory(CompileOptions(**options, plan=tmp_path / "a" / "plan.json"), tmp_path / "b")
    assert first.gpus_per_node == pinned.gpus_per_node == 2


def test_a_plan_given_with_plan_refuses_other_nodes(tmp_path, capsys):
    """--gpus-per-node 4 beside a plan for nodes of 2 was dropped without a word (the flag's
    default, 8, and a value typed looked alike): refused as any pin the plan contradicts."""
    from autopart.tools.cli import main

    model = str(REPO / "examples" / "gpt.py")
    main(["compile", model, "-o", str(tmp_path / "a"), "--pp", "2", "--dp", "2", "--microbatches", "2",
          "--gpus-per-node", "2", "--no-measure"])  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(["compile", model, "-o", str(tmp_path / "b"), "--plan", str(tmp_path / "a" / "plan.json"),
              "--gpus-per-node", "4", "--no-measure"])  # fmt: skip
    assert exit.value.code == 2
    assert "--gpus-per-node 4 contradicts plan.json, which --plan emits as it is (gpus_per_node 2)" in capsys.readouterr().err
