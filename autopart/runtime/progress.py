"""What rank 0 shows and writes of every step: the loss, tokens/s, achieved TFLOP/s per device
and MFU, on a live progress line (rich, when the output is a terminal), as plain lines
otherwise, as one JSON line per step in ``--metrics`` and as scalars in ``--tensorboard``.

MFU is model FLOPs utilisation as the PaLM paper defines it: the model's FLOPs of a step
(forward and backward, recompute not counted; ``plan.predicted.model_flops_per_step``, from the
compile's op costs) over the step's seconds, per device, divided by the device's dense peak in
the plan's precision (``plan.predicted.peak_flops``, from the device spec compiled for).
Tokens: the elements of the batch's first integer input (token ids), or else its samples.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopart.ir.errors import ConfigError
from autopart.ir.plan import Plan

__all__ = ["Throughput", "StepReporter", "check_tensorboard", "drop_steps_from", "tokens_in"]


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """How fast one step went, from its tokens, its seconds and the plan's FLOPs."""

    tokens_per_s: float
    tflops_per_device: float  # achieved, 1e12 FLOP/s
    mfu: float  # fraction of the device's peak; 0 when the plan holds no FLOPs (an older compile)

    @staticmethod
    def of(plan: Plan, *, tokens: int, step_s: float) -> Throughput:
        flops = plan.predicted.model_flops_per_step / step_s / plan.world_size if step_s > 0 else 0.0
        return Throughput(
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            tflops_per_device=flops / 1e12,
            mfu=flops / plan.predicted.peak_flops if plan.predicted.peak_flops > 0 else 0.0,
        )


def tokens_in(inputs: tuple[Any, ...]) -> int:
    """The tokens of a global batch: the elements of its first integer tensor, else its samples."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    ids = next((x for x in tensors if not x.is_floating_point() and x.dtype != torch.bool), None)
    if ids is not None:
        return ids.numel()
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1


def check_tensorboard(folder: Path | None) -> None:
    """Refuse ``--tensorboard`` before training starts when the package is missing."""
    if folder is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package; pip install 'autopart[tensorboard]' "
                          "or leave out --tensorboard")


class StepReporter:
    """Rank 0's report of a run: call `step` once per step, then `close`."""

    def __init__(self, *, steps: int, seconds: float | None, first_step: int, metrics: Path | None,
                 tensorboard: Path | None, resumed: bool = False) -> None:
        """``steps``, ``seconds``: train.py's ``--steps`` and ``--seconds``. A run given seconds stops
        at whichever comes first, so its bar counts steps without a total (nor a time left).
        ``resumed``: a ``--resume`` run or torchrun's restart of one that failed, which trains again
        from ``first_step`` the steps that the run before it may have reported after its checkpoint
        (all of them, where there is none); their records are dropped from
        ``metrics`` (`drop_steps_from`) and tensorboard's event files (its ``purge_step``), so that
        each step is reported once."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.metrics = metrics
        if metrics is not None:
            metrics.parent.mkdir(parents=True, exist_ok=True)
            if resumed:
                drop_steps_from(metrics, first_step)
        console = Console()
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), console=console, disable=not self.live,
        )  # fmt: skip
        self.task = self.progress.add_task("train", total=steps if seconds is None else None, completed=first_step,
                                           status="")
        self.progress.start()
        self.writer = None
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard), purge_step=first_step if resumed else None)

    def step(self, record: dict[str, Any], throughput: Throughput) -> None:
        """One step's ``record`` (step, loss, step_s, lr, ... as written to ``--metrics``)."""
        record = {**record, "tokens_per_s": throughput.tokens_per_s,
                  "tflops_per_device": throughput.tflops_per_device, "mfu": throughput.mfu}  # fmt: skip
        rates = (f"{throughput.tokens_per_s:,.0f} tok/s  {throughput.tflops_per_device:.3g} TFLOP/s/device  "
                 f"MFU {throughput.mfu:.1%}")
        status = f"loss {record['loss']:.4f}  {rates}"
        line = f"step {record['step']} loss {record['loss']:.6f} step_s {record['step_s']:.4f} {rates}"
        if "eval_loss" in record:
            line += f" eval_loss {record['eval_loss']:.6f}"
        if self.live:
            self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            self.progress.update(self.task, completed=record["step"] + 1, status=status)
        else:
            print(line, flush=True)
        if self.metrics:
            with open(self.metrics, "a") as file:
                file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "step_s"):
                if record.get(key) is not None:
                    tag = "eval/loss" if key == "eval_loss" else f"train/{key}"
                    self.writer.add_scalar(tag, record[key], record["step"])

    def close(self) -> None:
        self.progress.stop()
        if self.writer is not None:
            self.writer.close()


def drop_steps_from(metrics: Path, first_step: int) -> None:
    """Drop from a ``--metrics`` file the records of steps from ``first_step`` on, which a resumed
    run trains and reports again, with a note of how many. Every other line is kept as it was
    (one that is not such a record too); the file is replaced whole, never left half written."""
    if not metrics.is_file():
        return
    kept, dropped = [], 0
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None
        if isinstance(step, int) and step >= first_step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        staging = metrics.with_name(f".{metrics.name}.resumed")
        staging.write_text("".join(kept))
        os.replace(staging, metrics)
        print(f"autopart: note: dropped {dropped} records of steps {first_step} on from {metrics}: this resumed run "
              "trains those steps again and writes them anew", file=sys.stderr, flush=True)
