"""Run one rank's action list for one training step.

The action list is the same value that the simulator and the validator read
(``autopart.schedule``): F, B (or its halves I and W), and the sends and receives that lowering
inserted. Two neighbouring stages on one rank (interleaved with one rank) hand their tensors
over in memory, where lowering put no send and receive. The loss of every microbatch is divided
by the number of microbatches before its backward, so the gradients are those of the mean loss
over the global batch. Zero-bubble's I and W are `autopart.runtime.backward`'s split. A stage's
forward runs through its `StageForward` (the plan's precision and recompute); a recomputing
stage in a split backward rebuilds its graph once, at I, for I and W to share. The buffers that
a forward updates in place (a counter, BatchNorm's statistics) are left as one forward of the
whole global batch leaves them (`autopart.runtime.buffer_updates`), not once per microbatch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from autopart.ir.scatter_gather import held_shape
from autopart.ir.tensors import TensorMeta
from autopart.runtime.buffer_updates import BufferUpdates
from autopart.runtime.backward import PendingWeights, backward_full, backward_input, backward_weight
from autopart.runtime.device import Mark, StepTimer, batch_on_device
from autopart.runtime.draws import draw_seed
from autopart.runtime.forward import NoDropout, Rebuild, StageForward, buffers_kept
from autopart.runtime.p2p import Channels, Scatter, recv_tensors, send_tensors
from autopart.runtime.reducer import GradientReducer
from autopart.schedule import Action, Kind, Schedule, format_grid

__all__ = ["ActionRecord", "StageRuntime", "Executor", "StepFailure"]


class ActionRecord(NamedTuple):
    """One action as it ran: wall-clock start and end (``time.perf_counter``), and the CPU
    seconds of the running thread in between (what the action computed, without the time that
    other processes held the core or that a receive waited)."""

    action: Action
    start: float
    end: float
    cpu_s: float


class StepFailure(RuntimeError):
    """An action failed; the message names the rank, stage, microbatch and action."""


@dataclass(kw_only=True)
class StageRuntime:
    """One stage held by this rank, and what it keeps between its actions in a step."""

    index: int
    module: nn.Module
    inputs: list[TensorMeta]  # received tensors, one microbatch
    batch_inputs: list[int]  # positions in the graph inputs of the batch values it reads
    prev_rank: int | None
    next_rank: int | None
    forward: StageForward | None = None  # how F runs; by default the module itself, in fp32, keeping everything
    output_metas: list[TensorMeta] | None = None  # what the plan says it sends (checked in F)
    input_gradients: list[bool] | None = None  # per received tensor, whether a gradient goes back for it
    output_gradients: list[bool] | None = None  # per sent tensor, whether a gradient comes back for it
    rebuilds: dict[int, Rebuild] = field(default_factory=dict)  # recomputing stages in a split backward
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)  # the loss, or the tensors sent on
    output_grads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    held_for_weights: dict[int, PendingWeights] = field(default_factory=dict)

    def takes_input_gradients(self) -> list[bool]:
        """Per received tensor, whether it takes a gradient: as the plan says (one that nothing
        trained lies before takes none, `autopart.ir.plan.StagePlan.no_grad_inputs`), by default each floating one."""
        if self.input_gradients is not None:
            return self.input_gradients
        return [getattr(torch, meta.dtype).is_floating_point for meta in self.inputs]

    def takes_output_gradients(self, out: list[torch.Tensor]) -> list[bool]:
        """Per sent tensor ``out``, whether a gradient comes back for it (the next stage's `takes_input_gradients`)."""
        return self.output_gradients if self.output_gradients is not None else [t.is_floating_point() for t in out]


def unfinished(sends: list[Any]) -> list[Any]:
    """The posted sends still under way. A send's handle holds the tensor it sends (gloo's and
    NCCL's both) until the handle goes, so one kept to the step's end keeps every microbatch's
    activation and input gradient alive that long, past the backward that freed them, which the
    memory model does not count. Asking is no wait: under NCCL, waiting here would make the
    compute stream wait for a peer. (gloo calls a send complete only once waited for, so on the
    CPU they all stay to the step's end, where CPU memory is not what is planned.)"""
    under_way = []
    for work in sends:
        if work.is_completed():
            work.wait()  # no wait once done; raises for a send that failed, which is done too
        else:
            under_way.append(work)
    return under_way


class Executor:
    def __init__(
        self,
        *,
        rank: int,
        stages: dict[int, StageRuntime],
        last_stage: int,
        schedule: Schedule,
        microbatches: int,
        device: torch.device,
        scatter: Scatter | None = None,
        reducer: GradientReducer | None = None,
        channels: Channels | None = None,
        global_rank: int | None = None,
        replicas: tuple[Any, int] | None = None,
    ):
        """``scatter``: this rank's tensor-parallel group, over which messages are split (none: sent
        whole); ``channels``: the process groups messages travel on, per kind and direction
        (`autopart.runtime.p2p`), chosen by this process's ``global_rank`` and its peer's; None
        sends all of them on the default group. ``replicas``: the data-parallel group and its size,
        over which the buffers' updates are averaged too (`autopart.runtime.buffer_updates`)."""
        if channels is not None and global_rank is None:
            raise ValueError("Executor(channels=...) needs this process's global_rank: its messages' groups depend on it")
        self.channels = channels
        self.global_rank = global_rank
        self.rank = rank
        self.scatter = scatter
        self.reducer = reducer  # the data-parallel all-reduce, launched as the gradients become final
        self.stages = stages
        self.last_stage = last_stage
        self.schedule = schedule
        self.actions = schedule[rank]
        self.microbatches = microbatches
        self.device = device
        self.updates = {s: BufferUpdates(stage.module, replicas, getattr(stage.module, "updated_buffers", None))
                        for s, stage in stages.items()}

    def step(
        self,
        microbatches: list[tuple[Any, ...]],
        *,
        record: list[ActionRecord] | None = None,
        timer: StepTimer | None = None,
        seed: int | None = None,
    ) -> list[torch.Tensor]:
        """Run the action list on the microbatches (graph inputs, split); return the losses held
        here, one 0-d tensor per microbatch on the device: the caller reads them once per step,
        where a ``.item()`` per microbatch would stop the host until the device caught up.

        With ``record``, append an `ActionRecord` for every action: its start and end in
        ``time.perf_counter`` seconds (``timer``'s marks: on a GPU CUDA events, so the times are
        the kernels' own, resolved after the step) and the CPU time of this thread in between.
        With ``seed`` (train.py's, of this step and replica) every forward first seeds the
        generators with it, its microbatch and its stage (`autopart.runtime.draws.draw_seed`).
        """
        losses: list[torch.Tensor] = []
        pending: list[Any] = []
        if record is not None and timer is None:
            timer = StepTimer(self.device)
        marks: list[tuple[Action, Mark, Mark, float]] = []
        microbatches = self._on_device(microbatches)
        if self.reducer is not None:
            self.reducer.clock = timer.mark if timer is not None else time.perf_counter
        self._begin_step()
        for position, action in enumerate(self.actions):
            try:
                start = timer.mark() if record is not None else 0.0
                cpu = time.thread_time() if record is not None else 0.0
                if self.reducer is not None:
                    self.reducer.before(position, action)
                self._run(action, microbatches, losses, pending, seed)
                pending[:] = unfinished(pending)
                if record is not None:
                    marks.append((action, start, timer.mark(), time.thread_time() - cpu))
                if self.reducer is not None:  # outside the action's time: launching what it finished
                    self.reducer.after(position, action)
            except Exception as exc:
                raise self._failure(position, action, exc) from exc
        for work in pending:
            work.wait()
        for updates in self.updates.values():
            updates.finish()
        for stage in self.stages.values():
            assert not (
                stage.received or stage.outputs or stage.output_grads or stage.held_for_weights or stage.rebuilds
            ), (
                f"stage {stage.index} kept state past the end of the step: the schedule is incomplete"
            )
        if record is not None:
            timer.stop()
            record.extend(ActionRecord(a, timer.seconds(s), timer.seconds(e), c) for a, s, e, c in marks)
        return losses

    def evaluate(self, microbatches: list[tuple[Any, ...]]) -> list[torch.Tensor]:
        """Forward only, without autograd and without dropout (`NoDropout`): the step's F actions
        and their messages in the schedule's order (a subsequence of a deadlock-free list whose
        forward messages keep their order is deadlock-free too); return the losses held here, as
        `step` does."""
        losses: list[torch.Tensor] = []
        pending: list[Any] = []
        microbatches = self._on_device(microbatches)
        with torch.no_grad(), NoDropout(), buffers_kept([b for updates in self.updates.values() for b in updates.tracked_buffers()]):
            self._begin_step()
            for position, action in enumerate(self.actions):
                if action.kind not in _FORWARD_KINDS:
                    continue
                try:
                    self._run(action, microbatches, losses, pending, None, training=False)  # nothing is drawn
                    pending[:] = unfinished(pending)
                except Exception as exc:
                    raise self._failure(position, action, exc) from exc
        for work in pending:
            work.wait()
        for stage in self.stages.values():  # what a backward would have consumed
            stage.received.clear()
            stage.outputs.clear()
            stage.rebuilds.clear()
        return losses

    def _begin_step(self) -> None:
        """The weights' working copies of this step (`StageForward.begin_step`): the optimizer has
        stepped, or a checkpoint was loaded, since the last ones were cast."""
        for stage in self.stages.values():
            if stage.forward is not None:
                stage.forward.begin_step()

    def _failure(self, position: int, action: Action, exc: Exception) -> StepFailure:
        grid = format_grid(self.schedule, mark=(self.rank, position))
        return StepFailure(
            f"rank {self.rank}, stage {action.stage}, microbatch {action.microbatch}, action {action}: "
            f"{type(exc).__name__}: {exc}{_hint(exc)}\n{grid}"
        )

    def _run(
        self, action: Action, microbatches: list[tuple[Any, ...]], losses: list[torch.Tensor], pending: list,
        seed: int | None, *, training: bool = True,
    ) -> None:
        """One action; ``training`` False: an evaluation's forward, whose buffer updates `buffers_kept` puts back."""
        stage = self.stages[action.stage]
        m = action.microbatch
        kind = action.kind
        if kind is Kind.RECV_F:
            peer = _peer(stage, kind)
            stage.received[m] = recv_tensors(stage.inputs, peer, self.device, self.scatter, self._channel(kind, peer))
        elif kind is Kind.F:
            updates = self.updates[stage.index].forward() if training else contextlib.nullcontext()
            with updates:  # from the step's buffers; its updates averaged after the step
                self._forward(stage, m, microbatches, losses, seed)
        elif kind is Kind.SEND_F:
            peer = _peer(stage, kind)
            pending.extend(send_tensors(list(stage.outputs[m]), peer, self.scatter, self._channel(kind, peer),
                                        metas=stage.output_metas))
        elif kind is Kind.RECV_B:
            sent = stage.output_metas if stage.output_metas is not None else [_meta(t) for t in stage.outputs[m]]
            metas = [meta for takes, meta in zip(stage.takes_output_gradients(stage.outputs[m]), sent) if takes]
            peer = _peer(stage, kind)
            stage.output_grads[m] = recv_tensors(metas, peer, self.device, self.scatter, self._channel(kind, peer))
        elif kind in (Kind.B, Kind.I):
            with self.updates[stage.index].recompute():  # what a recompute writes is put back
                self._backward(stage, m, split=kind is Kind.I)
        elif kind is Kind.W:
            with self.updates[stage.index].recompute():
                backward_weight(stage.held_for_weights.pop(m))
        elif kind is Kind.SEND_B:
            metas = [meta for meta, takes in zip(stage.inputs, stage.takes_input_gradients()) if takes]
            peer = _peer(stage, kind)
            pending.extend(send_tensors(stage.input_grads.pop(m), peer, self.scatter, self._channel(kind, peer),
                                        metas=metas))
        else:
            raise AssertionError(f"unknown action kind {kind}")

    def connect(self) -> None:
        """Open the communicators of every channel and peer this rank's messages use, before the
        first step, in the one order every rank takes (`Channels.connect`)."""
        if self.channels is None:
            return
        messages = {(a.kind, _peer(self.stages[a.stage], a.kind)) for a in self.actions if not a.is_compute}
        try:
            self.channels.connect(messages, rank=self.global_rank, device=self.device)
        except Exception as exc:  # a peer that never came, or died as it started
            raise StepFailure(f"rank {self.rank}, opening its pipeline channels before the first step: "
                              f"{type(exc).__name__}: {exc}") from exc

    def _on_device(self, microbatches: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The batch values this rank's stages read, on its device (`batch_on_device`)."""
        return batch_on_device(microbatches, {i for s in self.stages.values() for i in s.batch_inputs}, self.device)

    def _channel(self, kind: Kind, peer: int) -> Any:
        return None if self.channels is None else self.channels.for_action(kind, rank=self.global_rank, peer=peer)

    def _forward(
        self, stage: StageRuntime, m: int, microbatches: list[tuple[Any, ...]], losses: list[torch.Tensor],
        seed: int | None,
    ) -> None:
        inputs = stage.received.get(m, [])
        for tensor, takes in zip(inputs, stage.takes_input_gradients()):
            if takes:  # else autograd records nothing that only it feeds: a frozen prefix runs no backward
                tensor.requires_grad_(True)
        batch = [microbatches[m][i] for i in stage.batch_inputs]  # on the device (`step`)
        if seed is not None:
            torch.manual_seed(draw_seed(seed, m, stage.index))  # every device's generator
        if stage.forward is None:
            out = stage.module(*inputs, *batch)
        else:
            out, rebuild = stage.forward(*inputs, *batch)
            if rebuild is not None:
                stage.rebuilds[m] = rebuild
        if stage.index == self.last_stage:
            losses.append(out.detach())
            out = out / self.microbatches
        elif stage.output_metas is not None:
            check_outputs(out, stage.output_metas, self.scatter.size if self.scatter else 1)
        stage.outputs[m] = out
        following = self.stages.get(stage.index + 1)
        if following is not None:  # the next stage is on this rank: hand the tensors over in memory
            following.received[m] = [t.detach() for t in out]

    def _differentiable(self, stage: StageRuntime, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs to differentiate and their incoming gradients (1 for the loss)."""
        out = stage.outputs.pop(m)
        if isinstance(out, torch.Tensor):
            return [out], [torch.ones_like(out)]
        taking = [t for t, takes in zip(out, stage.takes_output_gradients(out)) if takes]
        pairs = [(t, g) for t, g in zip(taking, stage.output_grads.pop(m)) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _backward(self, stage: StageRuntime, m: int, *, split: bool) -> None:
        if m in stage.rebuilds:  # recomputed, for I and W both: the outputs again, now with their whole graph
            assert stage.forward is not None and split
            out = stage.forward.rebuild(stage.rebuilds.pop(m))
            stage.outputs[m] = out / self.microbatches if stage.index == self.last_stage else out
        outputs, grads = self._differentiable(stage, m)
        received = stage.received.pop(m, [])
        inputs = [t for t, takes in zip(received, stage.takes_input_gradients()) if takes]
        if not outputs:  # nothing trained before its outputs: no backward, and no gradient goes back
            found: list[torch.Tensor | None] = [None] * len(inputs)
            if split:
                stage.held_for_weights[m] = PendingWeights()
        elif split:  # zero-bubble I: the input gradients now, the weight gradients left for W
            found, stage.held_for_weights[m] = backward_input(outputs, grads, inputs, list(stage.module.parameters()))
        else:
            found = backward_full(outputs, grads, inputs)
        if stage.index == 0:
            return  # no stage before this one wants the gradients of its inputs
        input_grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, found)]
        previous = self.stages.get(stage.index - 1)
        if previous is not None:  # the previous stage is on this rank: no message
            previous.output_grads[m] = input_grads
        else:
            stage.input_grads[m] = input_grads


_FORWARD_KINDS = (Kind.RECV_F, Kind.F, Kind.SEND_F)


def check_outputs(out: Any, metas: list[TensorMeta], tp: int = 1) -> None:
    """The tensors about to be sent are those the plan promised the next stage, which sizes its
    buffers by them (a sequence-parallel one: each rank's slice)."""
    produced = [_meta(t) for t in out]
    metas = [TensorMeta(shape=held_shape(m, tp), dtype=m.dtype) for m in metas]
    if produced != metas:
        wrong = next((i for i, (a, b) in enumerate(zip(produced, metas)) if a != b), min(len(produced), len(metas)))
        got = produced[wrong] if wrong < len(produced) else "nothing"
        promised = metas[wrong] if wrong < len(metas) else "nothing"
        raise RuntimeError(
            f"output {wrong} of the stage is {got}, but the plan sends {promised} and the next stage receives that; "
            "autocast on this device gives other dtypes than at compile time (CPU autocast), or the plan was compiled "
            "before --dtype bf16 meant bf16 working weights: recompile (--dtype fp32 where autocast differs)"
        )


def _hint(exc: Exception) -> str:
    """What to do about a failure the user can act on, after its message: CPU autocast refuses a
    bf16 norm weight beside fp32 values, which CUDA's runs in fp32 (a plan compiled for a GPU)."""
    if "mixed dtype (CPU)" in str(exc):
        return ("; on the CPU, autocast runs norms in their input's dtype, where CUDA's runs them in fp32: a bf16 "
                "plan compiled for a GPU runs there, or compile with --device cpu (or --dtype bf16-autocast) to run "
                "it on this CPU")
    return ""


def _peer(stage: StageRuntime, kind: Kind) -> int:
    """The global rank a message ``kind`` of ``stage`` goes to or comes from: activations come from
    the previous stage and go to the next, gradients the other way."""
    return stage.prev_rank if kind is Kind.RECV_F or kind is Kind.SEND_B else stage.next_rank


def _meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))
