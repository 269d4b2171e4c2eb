"""Several nodes simulated on this machine: one torchrun agent per node, each with its own copy of
OUT and its own command line, meeting through torchrun's rendezvous on the loopback."""

import dataclasses
import datetime
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ConfigError
from autopart.ir.plan import load_plan
from autopart.runtime.launch import RefusedTogether, check_launch
from tests.distributed import FREE_LINKS, REPO, environment, free_port, run_cli_here

MODEL = REPO / "tests" / "models" / "tiny_gpt.py"
RENDEZVOUS = "--rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id autopart"


def compiled(out: Path, **pins) -> Path:
    options = dict(model=MODEL, pp=2, dp=2, tp=1, microbatches=2, global_batch_size=4, gpus_per_node=2,
                   device=str(FREE_LINKS)) | pins
    compile_to_directory(CompileOptions(**options), out)
    return out


def nodes(outs: list[Path], nprocs: list[int], args: list[list[str]], timeout: float = 200) -> list[tuple[int, str]]:
    """Each node's agent (static rendezvous, ``--node-rank`` its index) started at once; each
    one's exit status and output. Every launch has a timeout: a node left waiting fails the test."""
    port = free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(outs)}", f"--nproc-per-node={nproc}",
             f"--node-rank={index}", "--master-addr=127.0.0.1", f"--master-port={port}", str(out / "train.py"),
             "--timeout", "100", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(),
        )
        for index, (out, nproc, extra) in enumerate(zip(outs, nprocs, args))
    ]  # fmt: skip
    try:
        logs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    return [(agent.returncode, log) for agent, log in zip(agents, logs)]


def autopart_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("autopart: error")]


@pytest.mark.multiprocess
def test_a_node_with_another_compile_is_refused_on_every_rank(tmp_path):
    first = compiled(tmp_path / "first")
    other = compiled(tmp_path / "other", pp=2, dp=1, tp=2)  # the same world size, another mesh
    results = nodes([first, other], [2, 2], [["--steps", "2"]] * 2, timeout=150)
    for code, log in results:
        assert code != 0, log[-3000:]
        lines = autopart_lines(log)
        assert len(lines) == 2, log[-3000:]  # one line per rank, no traceback
        assert all("rank 2 runs another compile than rank 0" in line for line in lines), lines
        # a worker's traceback ("[rankN]: Traceback"), not the agent's own report of a failed worker
        assert "]: Traceback" not in log and "exitcode  : 2" in log, log[-3000:]


@pytest.mark.multiprocess
def test_a_node_started_with_other_training_options_is_refused(tmp_path):
    out = compiled(tmp_path / "out")
    copy = tmp_path / "copy"  # the other node's own copy of OUT, byte for byte
    shutil.copytree(out, copy)
    results = nodes([out, copy], [2, 2], [["--steps", "2"], ["--steps", "3"]])
    for code, log in results:
        assert code != 0 and "]: Traceback" not in log, log[-3000:]
        lines = autopart_lines(log)
        assert lines == ["autopart: error: rank 2 was started with --steps 3 but rank 0 with --steps 2; give train.py "
                         "the same options on every node"] * 2, log[-3000:]


@pytest.mark.multiprocess
def test_nodes_compare_options_as_parsed_not_as_typed(tmp_path):
    """``--betas 0.9,0.95`` and ``0.90,0.950`` are the same rates: the nodes, each with its own
    copy of OUT, train. (Other rates are refused as --steps is above: tests/test_rank_exchange.py
    checks the comparison's every message.)"""
    out = compiled(tmp_path / "out")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    adamw = ["--steps", "1", "--optimizer", "adamw", "--betas"]
    for code, log in nodes([out, copy], [2, 2], [adamw + ["0.9,0.95"], adamw + ["0.90,0.950"]]):
        assert code == 0, log[-3000:]


@pytest.mark.multiprocess
def test_a_rank_that_refuses_to_start_is_named_on_the_other_node(tmp_path):
    """A refusal before the process group (here: node 1's OUT was compiled for 6 ranks) ends the
    other node's ranks too, at once, each with one line, instead of leaving them in the rendezvous."""
    first = compiled(tmp_path / "first")
    six = compiled(tmp_path / "six", pp=3, dp=2, tp=1, microbatches=3, global_batch_size=6)
    results = nodes([first, six], [2, 2], [["--steps", "2"]] * 2, timeout=150)
    expected = "the plan needs 6 processes but 4 were started"
    (code, log), (other_code, other_log) = results
    assert code != 0 and other_code != 0, log[-3000:]
    # the plan's own nodes (of 2 ranks, as it was compiled for), not this launch's
    assert autopart_lines(log) == [f"autopart: error: rank 2 cannot start: {expected}; run torchrun --nnodes 3 "
                                   f"--nproc-per-node 2 {RENDEZVOUS} {six / 'train.py'} on each of the 3 nodes (HOST: "
                                   "the first node's address)"] * 2, log[-3000:]
    assert len(autopart_lines(other_log)) == 2 and expected in other_log, other_log[-3000:]
    assert "]: Traceback" not in log + other_log


@pytest.mark.multiprocess
def test_too_few_processes_on_one_node_is_told_the_command_for_several_nodes(tmp_path):
    out = compiled(tmp_path / "out")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    results = nodes([out, copy], [2, 1], [["--steps", "2"]] * 2, timeout=150)
    for code, log in results:
        assert code != 0 and "]: Traceback" not in log, log[-3000:]
        assert all(f"the plan needs 4 processes but 3 were started; run torchrun --nnodes 2 --nproc-per-node 2 "
                   f"{RENDEZVOUS} " in line and line.endswith("train.py on each of the 2 nodes (HOST: the first node's "
                                                              "address)") for line in autopart_lines(log)), log[-3000:]
    assert sum(len(autopart_lines(log)) for _, log in results) == 3  # one line per rank


def test_a_compile_over_several_nodes_prints_the_command_for_each_node(tmp_path):
    out = tmp_path / "out"
    result = run_cli_here("compile", str(MODEL), "-o", str(out), "--pp", "2", "--dp", "2", "--tp", "1",
                          "--microbatches", "2", "--global-batch-size", "4", "--gpus-per-node", "2",
                          "--device", str(FREE_LINKS), "--no-measure")
    assert result.returncode == 0, result.stderr
    assert "on each of the 2 nodes" in result.stdout, result.stdout
    assert f"torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id autopart " \
           f"{out}/train.py --steps 10" in result.stdout, result.stdout


@pytest.mark.multiprocess
def test_nodes_of_unequal_size_run_the_commands_that_compile_printed(tmp_path, monkeypatch):
    """3 ranks on nodes of 2 devices: node 0 starts 2 and node 1 starts 1, each with its own
    --node-rank. The commands as compile printed them (HOST: this machine) train, and a launch of
    another size is told the same commands."""
    out = tmp_path / "out"
    result = run_cli_here("compile", str(MODEL), "-o", str(out), "--pp", "3", "--dp", "1", "--tp", "1",
                          "--microbatches", "3", "--global-batch-size", "3", "--gpus-per-node", "2",
                          "--device", str(FREE_LINKS), "--no-measure")
    assert result.returncode == 0, result.stderr
    printed = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("on node ")]
    assert [line.split(" --master-addr")[0] for line in printed] == [
        "on node 0: torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2",
        "on node 1: torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1"], result.stdout
    with pytest.raises(ConfigError) as refused:  # started on 2 nodes of 2: what each node runs instead
        check_launch(out, load_plan(out / "plan.json"), rank=0, world_size=4)
    commands = "; ".join(line.removesuffix(" --steps 10") for line in printed)
    assert str(refused.value) == (f"the plan needs 3 processes but 4 were started; run {commands} (HOST: the first "
                                  "node's address)")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # a plan that does not record its nodes: this launch's, filled
    with pytest.raises(ConfigError, match=f"; run {re.escape(commands)} "):
        check_launch(out, dataclasses.replace(load_plan(out / "plan.json"), gpus_per_node=None), rank=0, world_size=4)
    port = free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run",
             *shlex.split(line.split(": ", 1)[1].replace("HOST", "127.0.0.1").replace("29500", str(port)))[1:],
             "--steps", "2", "--timeout", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(),
        )
        for line in printed
    ]  # fmt: skip
    try:
        logs = [agent.communicate(timeout=200)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], logs[0][-3000:] + logs[1][-3000:]


@pytest.mark.multiprocess
def test_a_node_whose_command_line_is_refused_ends_the_other_node_with_one_line(tmp_path):
    out = compiled(tmp_path / "out")
    # the timeout that finds rank 2 missing also bounds how far apart node 0's own two ranks may
    # start (else rank 0 names rank 1): seconds apart on a loaded machine, so not 5
    results = nodes([out, out], [2, 2], [["--steps", "2", "--timeout", "20"], ["--steps", "2", "--stpes", "3"]])
    (code, log), (other_code, other_log) = results
    assert code != 0 and other_code != 0 and "]: Traceback" not in log + other_log, log[-3000:]
    assert autopart_lines(log) == ["autopart: error: rank 2 did not start within --timeout; see that node's output "
                                   "(its train.py options refused?), and give every node the same command"] * 2, log
    assert len(autopart_lines(other_log)) == 2 and "unrecognized arguments: --stpes" in other_log


@pytest.mark.multiprocess
def test_node_0_s_command_line_refused_ends_the_other_node_with_one_line(tmp_path):
    """Node 0's agent holds the store: its ranks refused, it ends and takes the store along, and
    the other node's ranks, waiting in it for every rank's start, lose it (DistNetworkError)."""
    out = compiled(tmp_path / "out")
    results = nodes([out, out], [2, 2], [["--steps", "2", "--stpes", "3"], ["--steps", "2", "--timeout", "5"]])
    (code, log), (other_code, other_log) = results
    assert code != 0 and other_code != 0 and "]: Traceback" not in log + other_log, other_log[-3000:]
    assert "unrecognized arguments: --stpes" in log
    lines = autopart_lines(other_log)
    assert len(lines) == 2 and all("see node 0's output" in line or "did not start within --timeout" in line
                                   for line in lines), other_log[-3000:]


def test_a_refusing_rank_leaves_only_once_every_peer_has_said_its_line():
    """torchrun's agent ends a node's other ranks as soon as one exits, so a rank that left
    straight after its line would cut off the line of a peer a moment slower."""
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    peer = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timeout)
    first = threading.Thread(target=RefusedTogether("refused", store=server, rank=0, ranks=[0, 1]).leave_together)
    first.start()
    first.join(timeout=1)
    assert first.is_alive()  # rank 0 said its line; rank 1 has not yet
    RefusedTogether("refused", store=peer, rank=1, ranks=[0, 1]).leave_together()
    first.join(timeout=30)
    assert not first.is_alive()


def test_an_error_of_the_batches_every_rank_draws_is_refused_together():
    """Every rank draws the model file's batches alike, so an error of theirs ends every rank at
    the same step: each waits for its peers' lines (`RefusedTogether`) rather than be cut off."""
    from autopart.ir.errors import ConfigError
    from autopart.runtime.launch import drawn_alike

    def batches():
        yield 1
        raise ConfigError("batches(4, 0) of short.py ran out after 1 global batches")

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        drawn = drawn_alike(batches(), store, 0)
        assert next(drawn) == 1
        with pytest.raises(RefusedTogether, match="ran out after 1 global batches") as refused:
            next(drawn)
    finally:
        dist.destroy_process_group()
    assert refused.value.ranks == [0] and refused.value.store is store
