"""The cost database: measured seconds of ops, saved as JSON, looked up by a key.

A key names everything that changes a measurement::

    cpu|torch 2.5.1|aten.linear(float32[2,32,64]:grad, float32[256,64]:weight, float32[256]:weight)

the device, the torch version and the op with the shapes and dtypes of its arguments (and
whether each is differentiated as an input or as a weight). Repeated layers produce the same
keys, so they are measured once; a second compile of the same model finds every key and times
nothing. Besides ops, the database holds optimizer steps per parameter shape and the fixed
costs of the runtime that no op carries (starting an autograd backward, calling a stage), and
the pipeline compute factors that ``autopart compile --profile-pipeline`` measures: how much
longer a model's stages compute inside their running pipeline than alone, keyed by the model
and its mesh (`autopart.profiling.pipeline.pipeline_key`).

The file is plain JSON so that it can be read, diffed, merged and checked in::

    {"schema": 2, "entries": {KEY: {"forward_s": .., "backward_input_s": .., "backward_weight_s": ..}},
     "overheads": {DEVICE: {"autograd_call_s": .., "module_call_s": .., "resume_forward_s": ..,
                            "resume_backward_s": ..}},
     "pipelines": {KEY: {"compute_factor": .., "stage_factors": {"FIRST-LAST": ..}, "tied_s": ..,
                         "optimizer_s": {"FIRST-LAST[,FIRST-LAST...]": ..},
                         "send_s": .., "recv_s": .., "transfer_s": ..}},
     "co_runs": {KEY: {"processes": .., "factor": .., "rounds": .., "micro_batch_size": ..}},
     "hosts": {DEVICE: [HOST, ..]}}

and how much slower the model computes with the other ranks of its host computing beside it
(`autopart.profiling.co_run`), keyed by precision and processes.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from autopart.ir.errors import ConfigError, read_user_file
from cost_models.calibration import write_json

__all__ = ["OpTimes", "RuntimeOverheads", "PipelineMeasurement", "CoRunMeasurement", "VARIATION_STEPS", "CostDatabase", "blocks_key", "plan_shape", "entry_key",
           "tail_key"]

_SCHEMA = 2
"""2: ops timed in place on the CPU (``autopart.profiling.in_situ``), optimizer steps less their fixed cost."""


@dataclass(frozen=True, kw_only=True)
class OpTimes:
    """Seconds of one op: forward, gradients of its inputs, gradients of its weights."""

    forward_s: float = 0.0
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True, kw_only=True)
class RuntimeOverheads:
    """Fixed costs of the runtime that belong to no op, measured on one device."""

    autograd_call_s: float = 0.0
    """Starting one ``torch.autograd.backward``/``grad``: paid once per backward action, and
    taken out of every op's measured backward, where the profiler's own call paid it."""
    module_call_s: float = 0.0
    """Calling a module (``nn.Module.__call__``): paid once per forward action."""
    resume_forward_s: float = 0.0
    """What a forward action costs more when another rank ran on its core just before it
    (caches, branch predictors and TLB refilled): paid by every forward when ranks share cores."""
    resume_backward_s: float = 0.0
    """The same for a backward action."""

    def action_costs(self, *, recompute: bool, split: bool) -> tuple[float, float, float]:
        """What one stage's forward, backward and weight-gradient actions cost beyond their
        compute, as `autopart.schedule.StageCosts` takes them (its I is the backward less W): a
        forward calls the stage; a backward starts autograd once, twice when ``split`` into I and W
        (zero bubble), and calls the stage again when it ``recompute``s; W starts its own."""
        backward = self.autograd_call_s * (2 if split else 1) + (self.module_call_s if recompute else 0.0)
        return self.module_call_s, backward, self.autograd_call_s if split else 0.0


VARIATION_STEPS = 64
"""Steps of a pipeline's profile whose variation the cost database keeps (`PipelineMeasurement`)."""


@dataclass(frozen=True, kw_only=True)
class PipelineMeasurement:
    """What one pipeline of one model measured as it ran (``autopart compile --profile-pipeline``)."""

    compute_factor: float
    """Its stages' forwards and backwards took this many times their profiled time, all together."""
    stage_factors: dict[str, float] = field(default_factory=dict)
    """The same per stage, keyed by the stage's first and last block (``"0-7"``): a stage of
    other blocks, after the cuts moved, takes ``compute_factor``."""
    tied_s: float | None = None
    """Summing the gradients of tied parameters took this long, on the holder that came last
    to it (the others wait for it there); None where the model ties none across ranks."""

    optimizer_s: dict[str, float] = field(default_factory=dict)
    """The optimizer step at the end of the step, per pipeline rank, keyed by the blocks of the
    rank's stages (``"0-7"``, ``"0-3,8-11"``; its slowest tensor- or data-parallel copy)."""
    send_s: float | None = None
    """A pipeline message as it ran there (`autopart.schedule.StageCosts`' terms): the rank time
    of a send, of a receive whose data is there, and the rest of the one-way time."""
    recv_s: float | None = None
    transfer_s: float | None = None
    waited_s: float | None = None
    """A receive that was posted before its data left: from the end of its send to its own end
    (gloo hands a waiting receive its data as the send completes, sooner than ``recv_s``, the
    unpacking of data that came first); None in databases written before it was kept."""
    step_variation: tuple[dict[str, float], ...] = ()
    """How single steps differed from the median one: per measured step (at most
    `VARIATION_STEPS`, evenly spaced), keyed by action (``"0F1"``, ``"1RECV_F1"``): a compute
    action's or a send's time as a multiple of that action's median over the steps, and for a
    receive the seconds by which its delivery (from the later of its start and its send's end to
    its end) was longer than that receive's median delivery over the steps; ``"tail 0"``:
    pipeline rank 0's tail (tied sums and optimizer step) as a multiple of its median."""
    step_s: float | None = None
    """The median step as it ran (the slowest rank's, from its start to its optimizer step's
    end: ``train.py``'s ``step_s``), of the plan that `step_of` names (`plan_shape`)."""
    step_of: str = ""
    background_load: float = 0.0
    """Other busy processes on the machine's cores when it ran (the compile's
    `cost_models.calibration.background_load`): its times hold their share of the cores already."""

    def stage_factor(self, blocks: tuple[int, int]) -> float:
        return self.stage_factors.get(blocks_key([blocks]), self.compute_factor)

    def optimizer_time(self, blocks: Sequence[tuple[int, int]]) -> float | None:
        """The optimizer step of a rank that holds the stages of these blocks, if measured."""
        return self.optimizer_s.get(blocks_key(blocks))


@dataclass(frozen=True, kw_only=True)
class CoRunMeasurement:
    """A model's forward and backward took ``factor`` times its time alone with ``processes``
    processes (itself included) computing at once on this host (`autopart.profiling.co_run`)."""

    processes: int
    factor: float
    rounds: int = 0
    micro_batch_size: int = 0
    """The micro-batch size it was measured at (0: not recorded)."""


_MOST_SECONDS = 1e6
"""More than any one op, message or step takes (11 days): a figure past it is no measurement."""


def _finite(value: object) -> float:
    """``value`` as a float, refusing what no measurement gives: NaN, infinity (which the search
    carries into every sum and never finishes with) and magnitudes past `_MOST_SECONDS`."""
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or abs(number) > _MOST_SECONDS:
        raise ValueError(f"{value!r} is not a measured figure (a finite number within {_MOST_SECONDS:g})")
    return number


def _seconds(value: object) -> float:
    """An op's or the runtime's measured time: also at least 0."""
    return _not_negative(value, "a time in seconds")


def _load(value: object) -> float:
    """A count of busy processes beside a measurement: at least 0 (a negative one would add to
    the load that a prediction counts, `autopart.predict.step_time.counted_background_load`)."""
    return _not_negative(value, "a count of busy processes")


def _not_negative(value: object, what: str) -> float:
    number = _finite(value)
    if number < 0:
        raise ValueError(f"{value!r} is not {what} (at least 0)")
    return number


def _host_names(value: object) -> list[str]:
    """A device's hosts as the file lists them: a string would read as one host per letter."""
    if not isinstance(value, list) or not all(isinstance(host, str) for host in value):
        raise TypeError(f"hosts {value!r} are not a list of host names")
    return list(value)


def plan_shape(schedule: str, microbatches: int, blocks: Sequence[tuple[int, int]]) -> str:
    """``"1f1b x8: 0-6,7-12"``: a plan's schedule, microbatches and stages, as `PipelineMeasurement.step_of` names them."""
    return f"{schedule} x{microbatches}: {blocks_key(blocks)}"


def blocks_key(blocks: Sequence[tuple[int, int]]) -> str:
    """``"0-3,8-11"``: the first and last block of each stage, as `PipelineMeasurement` keys them."""
    return ",".join(f"{first}-{last}" for first, last in blocks)


def tail_key(rank: int) -> str:
    """``"tail 0"``: the key of pipeline rank 0's tail in `PipelineMeasurement.step_variation`."""
    return f"tail {rank}"


def entry_key(device: str, op_key: str) -> str:
    return f"{device}|torch {torch.__version__}|{op_key}"


@dataclass(kw_only=True)
class CostDatabase:
    """Measured costs, keyed by `entry_key`; `timed` counts the measurements made this session."""

    path: Path | None = None
    entries: dict[str, OpTimes] = field(default_factory=dict)
    overheads: dict[str, RuntimeOverheads] = field(default_factory=dict)
    pipelines: dict[str, PipelineMeasurement] = field(default_factory=dict)
    co_runs: dict[str, CoRunMeasurement] = field(default_factory=dict)
    hosts: dict[str, list[str]] = field(default_factory=dict)
    """Per device, the hosts its figures were measured on (empty in databases written before it was kept)."""
    timed: int = 0

    @staticmethod
    def load(path: str | Path, *, missing_ok: bool = True) -> CostDatabase:
        """The database at ``path``; an empty one bound to ``path`` when the file does not exist yet."""
        path = Path(path)
        if not path.exists():
            if not missing_ok:
                raise ConfigError(f"cost database {path} does not exist; write one with 'autopart profile MODEL.py -o {path}'")
            return CostDatabase(path=path)
        text = read_user_file(path, ConfigError, "cost database", "give one that 'autopart profile' wrote, or a new "
                              "path to write one at")
        try:
            data = json.loads(text.decode())
            if not isinstance(data, dict) or "schema" not in data:  # another JSON file, not one of an earlier schema
                what = "a plan that autopart compile wrote" if isinstance(data, dict) and {"mesh", "stages"} <= \
                    data.keys() else "JSON without a cost database's schema"
                raise ConfigError(f"cost database {path} is not one but {what}; give one that 'autopart profile' "
                                  "wrote, or a new path to write one at")
            if data.get("schema") != _SCHEMA:
                raise ConfigError(f"cost database {path} has schema {data.get('schema')!r}, not {_SCHEMA}; profile again")
            entries = {str(k): OpTimes(**{n: _seconds(v[n]) for n in ("forward_s", "backward_input_s", "backward_weight_s")})
                       for k, v in data["entries"].items()}
            overheads = {str(k): RuntimeOverheads(**{n: _seconds(x) for n, x in v.items()})
                         for k, v in data.get("overheads", {}).items()}
            pipelines = {str(k): PipelineMeasurement(
                compute_factor=_finite(v["compute_factor"]),
                stage_factors={str(b): _finite(f) for b, f in v.get("stage_factors", {}).items()},
                optimizer_s={str(b): _finite(t) for b, t in v.get("optimizer_s", {}).items()},
                **{n: None if v.get(n) is None else _finite(v[n])
                   for n in ("tied_s", "send_s", "recv_s", "transfer_s", "waited_s", "step_s")},
                step_variation=tuple({str(b): _finite(m) for b, m in step.items()} for step in v.get("step_variation", ())),
                step_of=str(v.get("step_of", "")),
                background_load=_load(v.get("background_load", 0.0)),
            ) for k, v in data.get("pipelines", {}).items()}
            co_runs = {str(k): CoRunMeasurement(processes=int(v["processes"]), factor=_finite(v["factor"]),
                                                rounds=int(v.get("rounds", 0)),
                                                micro_batch_size=int(v.get("micro_batch_size", 0)))
                       for k, v in data.get("co_runs", {}).items()}
            hosts = {str(d): _host_names(v) for d, v in data.get("hosts", {}).items()}
        except ConfigError:
            raise
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise ConfigError(f"cost database {path} is not a valid cost database ({exc}); "
                              "give one that 'autopart profile' wrote, or a new path to write one at") from None
        return CostDatabase(path=path, entries=entries, overheads=overheads, pipelines=pipelines, co_runs=co_runs,
                            hosts=hosts)

    def get(self, device: str, op_key: str) -> OpTimes | None:
        return self.entries.get(entry_key(device, op_key))

    def measured_here(self, device: str) -> None:
        """Record that ``device``'s figures are being measured on this host: a compile that reads
        them elsewhere says whose they are (`autopart.predict.accuracy.basis_for`)."""
        hosts = self.hosts.setdefault(device, [])
        if socket.gethostname() not in hosts:
            hosts.append(socket.gethostname())

    def measured_on(self) -> list[str]:
        """Every host any of the figures were measured on, as recorded."""
        return sorted({host for hosts in self.hosts.values() for host in hosts})

    def put(self, device: str, op_key: str, times: OpTimes) -> None:
        self.entries[entry_key(device, op_key)] = times
        self.measured_here(device)
        self.timed += 1

    def pipeline(self, device: str, key: str) -> PipelineMeasurement | None:
        return self.pipelines.get(entry_key(device, key))

    def put_pipeline(self, device: str, key: str, measured: PipelineMeasurement) -> None:
        self.pipelines[entry_key(device, key)] = measured
        self.measured_here(device)

    def co_run(self, device: str, key: str) -> CoRunMeasurement | None:
        return self.co_runs.get(entry_key(device, key))

    def put_co_run(self, device: str, key: str, measured: CoRunMeasurement) -> None:
        self.co_runs[entry_key(device, key)] = measured
        self.measured_here(device)
        self.timed += 1

    def devices(self) -> set[str]:
        return {key.split("|", 1)[0] for key in self.entries}

    def to_json(self) -> dict:
        return {
            "schema": _SCHEMA,
            "entries": {k: asdict(v) for k, v in sorted(self.entries.items())},
            "overheads": {k: asdict(v) for k, v in sorted(self.overheads.items())},
            "pipelines": {k: asdict(v) for k, v in sorted(self.pipelines.items())},
            "co_runs": {k: asdict(v) for k, v in sorted(self.co_runs.items())},
            "hosts": {k: sorted(v) for k, v in sorted(self.hosts.items())},
        }

    def save(self, path: str | Path | None = None) -> Path:
        """Written atomically: two compiles sharing one database never leave half a file."""
        target = Path(path or self.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json(target, self.to_json(), indent=1)
        return target
