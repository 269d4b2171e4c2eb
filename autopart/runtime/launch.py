"""Checks that every rank makes before its first collective, and the fault-injection hook of tests.

A rank that would fail later (a missing stage file, weights from another compile, the wrong
number of processes) fails here instead, alone, with one line that says what to do, rather than
leaving its peers waiting in a collective until their timeout.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from autopart.ir.errors import AutopartError, ConfigError
from autopart.ir.plan import Plan
from autopart.runtime.exchange import gather_json
from autopart.runtime.mesh import Mesh
from autopart.runtime.shards import weights_file_name
from autopart.runtime.stage import checked_stage_source
from autopart.runtime.torchrun_command import Launch, node_sizes, plan_launch

__all__ = ["PLAN_HASH_KEY", "file_sha256", "plan_digest", "check_launch", "older_torch", "check_output",
           "check_world_size", "check_nodes_agree", "drawn_alike", "inject_failure", "init_process_group",
           "leave_with_node", "RefusedTogether"]

T = TypeVar("T")

PLAN_HASH_KEY = "autopart_plan_sha256"  # safetensors metadata of every weights file: the plan it was written with


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in blocks (a checkpoint's files may be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def plan_digest(plan_path: Path) -> str:
    """The sha256 of ``plan.json`` as written, but for its schedule's action lists: weights and
    checkpoints carry it to name their compile, and a hand-edited order of the actions (which the
    runtime runs as given) trains the same parameters, so it must not orphan them. A plan without
    the lists hashes as its file did."""
    try:
        data = json.loads(plan_path.read_text())
    except (OSError, ValueError):
        return file_sha256(plan_path)
    schedule = data.get("schedule") if isinstance(data, dict) else None
    if not isinstance(schedule, dict) or "actions" not in schedule:
        return file_sha256(plan_path)
    del schedule["actions"]
    return hashlib.sha256((json.dumps(data, indent=2) + "\n").encode()).hexdigest()


def check_world_size(plan: Plan, world_size: int, command: str) -> None:
    """That as many processes started as the plan has ranks; ``command`` is what to run instead."""
    if world_size != plan.world_size:
        started = "1 was" if world_size == 1 else f"{world_size} were"
        raise ConfigError(f"the plan needs {plan.world_size} processes but {started} started; run {command}")


def check_launch(out_dir: Path, plan: Plan, *, rank: int, world_size: int) -> None:
    """World size, this rank's stage files and weights, and that they come from this plan's compile."""
    train = shlex.quote(str(out_dir / "train.py"))  # a command to paste: a folder of spaces stays one word
    check_world_size(plan, world_size, _launch_command(plan, train))
    mesh = Mesh.of(plan)
    here = mesh.coordinates(rank)
    digest = plan_digest(out_dir / "plan.json")
    if (out_dir / "model.py").is_file() and file_sha256(out_dir / "model.py") != plan.provenance.model_sha256:
        raise ConfigError(f"model.py in {out_dir} is not the model file that was compiled (its sha256 differs from "
                          "plan.json's); recompile with autopart compile")
    for stage in plan.stages:
        if stage.rank != here.pp:
            continue
        source = out_dir / "stages" / f"stage_{stage.index}.py"
        weights = out_dir / "weights" / weights_file_name(stage.index, here.tp, mesh.tp)
        for path in (source, weights):
            if not path.is_file():
                raise ConfigError(
                    f"rank {rank} needs {path.relative_to(out_dir)} of stage {stage.index}, which is missing from "
                    f"{out_dir}; recompile with autopart compile or copy the whole output directory"
                )
        checked_stage_source(out_dir, plan, stage.index)
        try:
            with safe_open(str(weights), framework="pt") as handle:
                written_with = (handle.metadata() or {}).get(PLAN_HASH_KEY)
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"rank {rank} cannot read {weights} ({exc}); recompile with autopart compile") from None
        if written_with != digest:
            raise ConfigError(
                f"{weights.relative_to(out_dir)} was not written by the compile that wrote plan.json "
                f"(plan sha256 {digest[:12]}, weights made for {str(written_with)[:12]}); "
                "recompile with autopart compile instead of mixing output directories"
            )


def older_torch(plan: Plan) -> str | None:
    """What to say where this torch is older than the one that compiled ``plan``: the stage files
    call the ops that torch traced, and an older torch may lack one (a laptop's new torch compiles
    for a cluster's older one). A newer torch keeps what an older one had; None then."""
    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())

    compiled, here = plan.provenance.torch_version, torch.__version__
    if release(here) >= release(compiled):
        return None
    return (f"the plan was compiled under torch {compiled} and runs under torch {here}; a stage that calls an op "
            f"this torch lacks fails at its first step: compile under this torch if one does")


def _launch_command(plan: Plan, train: str) -> str:
    """The torchrun command(s) that start ``plan`` (`plan_launch`); for a plan that does not record
    its nodes, over as many nodes as this launch has (torchrun's GROUP_WORLD_SIZE), filled in
    order: a one-node command would be no advice to a user whose nodes each hold part of the ranks."""
    if plan.gpus_per_node is not None:
        return plan_launch(plan, train).one_line()
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    return Launch(train=train, sizes=node_sizes(plan.world_size, math.ceil(plan.world_size / nodes))).one_line()


def check_output(out_dir: Path, plan: Plan) -> None:
    """`check_launch` of every rank of one replica (the others read the same files): what a run of
    ``out_dir`` as it is now would refuse, refused before one starts."""
    mesh = Mesh.of(plan)
    for rank in range(plan.world_size):
        if mesh.coordinates(rank).dp == 0:
            check_launch(out_dir, plan, rank=rank, world_size=plan.world_size)


def check_nodes_agree(out_dir: Path, args: argparse.Namespace, store: dist.Store | None) -> None:
    """That every rank runs the same compile with the same training flags, checked over the world
    group before any other collective. Each node of a multi-node launch reads its own copy of OUT
    and its own command line, and each node's checks above pass on their own: a node whose OUT was
    recompiled (another mesh) would wait in a process group its peers never make, until the
    timeout, and one with another schedule, --steps, --lr or --seed would train a different
    model or stop at another step. Options are compared as argparse parsed them (``--betas
    0.9,0.95`` is ``--betas 0.90,0.950``), sent as JSON (`gather_json`): nothing a peer sends is
    unpickled. Paths are compared only as given or not (a shared folder may be mounted under
    another name on each node), and --timeout not at all. Every rank refuses the same
    (`RefusedTogether`, in ``store``, as `init_process_group` gave it)."""
    flags = {name: (value is not None) if name in _PATHS else value
             for name, value in sorted(vars(args).items()) if name != "timeout"}
    everyone = gather_json({"plan.json": file_sha256(out_dir / "plan.json"), "flags": flags})
    assert everyone is not None
    together = dict(store=store, rank=dist.get_rank(), ranks=list(range(len(everyone))))
    for rank, theirs in enumerate(everyone):
        if theirs["plan.json"] != everyone[0]["plan.json"]:
            raise RefusedTogether(f"rank {rank} runs another compile than rank 0 (their plan.json differs); copy the "
                                  "same output directory to every node instead of compiling on each", **together)
        differing = [name for name in flags if theirs["flags"].get(name) != everyone[0]["flags"].get(name)]
        if differing:
            said = [_said(differing[0], f["flags"].get(differing[0])) for f in (theirs, everyone[0])]
            raise RefusedTogether(f"rank {rank} was started with {said[0]} but rank 0 with {said[1]}; give train.py "
                                  "the same options on every node", **together)


# options that name a file or folder: compared as given or not
_PATHS = frozenset(("metrics", "trace", "action_times", "save_weights", "weights", "checkpoint_dir", "tensorboard"))


def _said(name: str, value: Any) -> str:
    """How an option was given, in a message (a path flag, or a switch, as given or not)."""
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return option if value else f"no {option}"
    if value is None:  # an option given on one node and not on another (--betas, --clip-grad-norm)
        return f"no {option}"
    if isinstance(value, list):  # a tuple flag (--betas), as JSON brought it
        return f"{option} {','.join(map(str, value))}"
    return f"{option} {value}"


def inject_failure(rank: int, step: int, *, saving: bool = False) -> None:
    """Test hook: ``AUTOPART_FAIL_AT=RANK:STEP`` ends that rank at the start of that step, and
    ``RANK:STEP:hang`` makes it stop answering instead, ``RANK:STEP:abort`` kills it with SIGABRT
    (as a collective library's failed check does), ``RANK:STEP:save`` ends it as it starts to save
    the checkpoint after that step (``saving``); only in torchrun's first attempt."""
    spec = os.environ.get("AUTOPART_FAIL_AT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    parts = spec.split(":")
    if int(parts[0]) != rank or int(parts[1]) != step or (len(parts) > 2 and parts[2] == "save") != saving:
        return
    if len(parts) > 2 and parts[2] == "hang":
        print(f"autopart: AUTOPART_FAIL_AT: rank {rank} stops answering at step {step}", file=sys.stderr, flush=True)
        time.sleep(3600)
    if len(parts) > 2 and parts[2] == "abort":
        os.abort()
    print(f"autopart: AUTOPART_FAIL_AT: rank {rank} dies at step {step}", file=sys.stderr, flush=True)
    os._exit(17)


def init_process_group(backend: str, timeout_s: float, refusal: str | None = None) -> dist.Store | None:
    """``init_process_group`` whose store keys are kept apart per torchrun attempt; with
    ``refusal`` (what this rank refused before it could start), that told to every rank and
    raised instead. The store under torchrun, where its ranks may wait for each other (None
    without torchrun's agent store).

    torchrun's static rendezvous (``--master-addr``/``--master-port``, the default) keeps one
    agent store across ``--max-restarts`` attempts without a per-attempt prefix, so a restarted
    rank would read the dead attempt's addresses and fail to connect. A prefix with the restart
    count gives every attempt its own keys.

    Under torchrun every rank first posts what it refused, or nothing, in that store and reads
    every other's. On several nodes a rank that leaves alone (its node's OUT or command line is
    another) is a failure of its own agent only: the other nodes' ranks would wait for it in the
    rendezvous of the process group until --timeout and end in a traceback. So every rank ends
    with one line that names the rank that refused, before any process group is made.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        alone = os.environ.get("RANK", "0") == "0" and os.environ.get("WORLD_SIZE", "1") == "1"
        if refusal is None and alone:
            # ``python OUT/train.py`` of a 1-rank plan (`check_launch` refused any other), a shell's
            # WORLD_SIZE=1 or RANK=0 beside it or not: a world of this process alone, whose store is
            # in memory, with no port to find or to lose
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        elif refusal is None:
            dist.init_process_group(backend, timeout=timeout)
        return None  # a refusal: the caller raises it (every rank reads the same OUT and flags on one node)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        store = _agent_store(timeout)
        _tell_refusals(store, rank, world_size, refusal)
    except dist.DistNetworkError:  # node 0's agent ended, its store with it: its ranks left before they posted
        raise ConfigError(refusal or "torchrun's store on node 0 closed before every rank started; see node 0's "
                          "output (its train.py options refused?), and give every node the same command") from None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return store


def _agent_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's agent store, under this attempt's prefix (see `init_process_group`)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"autopart/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _tell_refusals(store: dist.Store, rank: int, world_size: int, refusal: str | None) -> None:
    """Post this rank's refusal ("" for none), wait for every rank's, and refuse with this one's,
    or else the first other rank's."""
    store.set(f"refusal/{rank}", refusal or "")
    keys = [f"refusal/{other}" for other in range(world_size)]
    try:
        store.wait(keys)
    except dist.DistStoreError:  # a rank that left before it could post (argparse refused its command line)
        posted = [other for other, key in enumerate(keys) if store.check([key])]
        missing = sorted(set(range(world_size)) - set(posted))
        if missing:  # else the last came just after the wait ended: read them all as below
            raise RefusedTogether(f"rank {missing[0]} did not start within --timeout; see that node's output (its "
                                  "train.py options refused?), and give every node the same command",
                                  store=store, rank=rank, ranks=posted) from None
    everyone = list(range(world_size))
    if refusal is not None:
        raise RefusedTogether(refusal, store=store, rank=rank, ranks=everyone)
    for other, said in enumerate(store.multi_get(keys)):
        if said:
            raise RefusedTogether(f"rank {other} cannot start: {said.decode()}", store=store, rank=rank, ranks=everyone)


class RefusedTogether(ConfigError):
    """A refusal that ``ranks`` all make at once: read from the agent store, found in the
    start-up all-gather, or their node's command line refused. torchrun's agent ends the other
    ranks of its node (SIGTERM) as soon as one of them exits, and node 0's agent ends the store
    with it, so a rank that left straight after its line would cut off the line of a peer a
    moment slower (a loaded machine) on its own node, and the reads of another node's. Each
    rank therefore, after its line, posts that it said it and waits for every one of ``ranks``
    before it exits (`leave_together`)."""

    def __init__(self, message: str, *, store: dist.Store | None, rank: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.store, self.rank, self.ranks = store, rank, ranks

    def leave_together(self) -> None:
        """Once this rank's line is out: wait until every one of ``ranks`` has said its own."""
        if self.store is not None:
            _said_together(self.store, self.rank, self.ranks)


def _said_together(store: dist.Store, rank: int, ranks: list[int]) -> None:
    """Post that ``rank`` said its line and wait, a bounded time, for every one of ``ranks``.
    Peers past the same decision say theirs within moments; a peer ended meanwhile (its node's
    agent stopped it) or a store gone (node 0's agent ended) must not hold this rank up to
    --timeout, and cost nothing but the wait."""
    try:
        store.set(f"said/{rank}", "")
        store.wait([f"said/{other}" for other in ranks], datetime.timedelta(seconds=_SAID_WAIT_S))
    except dist.DistError:
        pass


_SAID_WAIT_S = 60.0  # far above the moments that peers past the same decision take to say their lines


def drawn_alike(items: Iterator[T], store: dist.Store | None, rank: int) -> Iterator[T]:
    """``items``, the model file's batches, which every rank draws alike: an error of theirs (they
    ran out, the user's code raised) stops every rank at the same step, and is refused together
    (`RefusedTogether`), so that no rank's line is cut off by its node's agent ending it."""
    try:
        yield from items
    except AutopartError as error:
        raise RefusedTogether(str(error), store=store, rank=rank, ranks=list(range(dist.get_world_size()))) from None


def leave_with_node() -> None:
    """After a refusal of this node's command line (argparse's line printed, exit 2): every rank
    of the node refuses the same, so each waits, as `RefusedTogether.leave_together`, until all
    of the node's ranks (torchrun numbers them one after another) have said theirs."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    first = int(os.environ["RANK"]) - int(os.environ["LOCAL_RANK"])
    node = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    try:
        store = _agent_store(datetime.timedelta(seconds=_SAID_WAIT_S))
    except dist.DistError:  # node 0's agent gone: no peer is left to wait for
        return
    _said_together(store, int(os.environ["RANK"]), list(node))
