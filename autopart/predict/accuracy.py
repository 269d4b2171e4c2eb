"""What a predicted step rests on, and how far a benchmark found such predictions off.

Every predicted step autopart prints carries its basis (what was measured, what was taken from a
device spec) and the error band of that basis: the median and worst |predicted - measured| /
measured over the rows of the benchmark that checks it. The bands live in ``accuracy.json``
beside this module, which the benchmarks write (``benchmarks/cost_accuracy.py`` for this
machine's measured costs, ``benchmarks/published_runs.py`` for the GPU specs' roofline), with
the command and the date: the figure a user is told to trust is the one a benchmark last
measured, never a number typed into the code.
"""

from __future__ import annotations

import datetime
import json
import re
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopart.ir.errors import ConfigError

if TYPE_CHECKING:
    from autopart.ir.plan import Plan

__all__ = ["ACCURACY_FILE", "FULLY_SHARDED", "MEASURED", "MEASURED_PIPELINE", "MFU_CEILING", "OF_LAYOUT", "PROFILED",
           "ROOFLINE", "Band", "Basis", "band_key", "basis_for", "ceiling_step_s", "describe_prediction", "implied_mfu",
           "layout_of", "load_bands", "mfu_clause", "with_basis", "write_band"]

ACCURACY_FILE = Path(__file__).with_name("accuracy.json")
"""The bands the repository ships, one per basis key (see `basis_for`)."""

MEASURED = "measured"
"""Ops timed in place and messages measured on the machine at hand: the default compile where it
does not run the plan (a search, more than two ranks per core, a pipeline run that failed)."""
MEASURED_PIPELINE = "measured-pipeline"
"""Ops, messages and the plan's own pipeline measured on the machine at hand: the default compile
of a layout given in full on a CPU (`autopart.profiling.measure_defaults`)."""
PROFILED = "profiled"
"""Ops from a cost database (``--costs``), and, with ``--profile-pipeline``, the pipeline run first."""
ROOFLINE = "roofline"
"""A device spec's roofline and link figures: nothing measured."""
OF_LAYOUT = "@"
"""Between a basis key and a layout (`layout_of`), the key of that basis's band over the
benchmark's rows of that layout alone ("cpu-measured-pipeline@pp+dp"): replicas that reduce
gradients beside a pipeline are priced by other figures (the reduction, more ranks sharing the
cores) and are off by other amounts than pipelines alone, whose band the basis key holds."""
FULLY_SHARDED = "-zero3"
"""Added to a basis key, the band of that basis over the benchmark's ZeRO-3 rows alone: a plan
that gathers its layers' weights for every forward and backward is priced by other figures
(the gathers beside the compute) and is off by other amounts than the rest."""


@dataclass(frozen=True, kw_only=True)
class Band:
    """How far predictions of one basis were off in the benchmark that wrote it."""

    median: float
    """Median |predicted - measured| / measured over the benchmark's rows."""
    worst: float
    """Largest |predicted - measured| / measured over the benchmark's rows."""
    rows: int
    benchmark: str
    """The benchmark's short name, as the printed line names it (``cost_accuracy``)."""
    command: str
    date: str
    covers: tuple[str, ...] = ()
    """The devices and precisions its rows ran on ("h100-sxm/bf16"): a named device's band holds
    for those alone (its kernel efficiencies and links are other figures elsewhere), as the machine
    at hand's holds for the precisions its rows ran in ("cpu/fp32"); (): a band written without them,
    taken to hold for any."""
    layouts: tuple[str, ...] = ()
    """The layouts its rows ran (`layout_of`: "pp", "pp+dp", ...): a step model checked on
    pipelines alone says nothing of how far off it is where replicas reduce gradients or ranks
    split ops, whose messages and core sharing are other figures; (): taken to hold for any."""
    zero: tuple[int, ...] = ()
    """The ZeRO levels its rows ran: ZeRO-0 all-reduces the gradients, ZeRO-1 gathers the updated
    shards too, ZeRO-2/3 gather and reduce-scatter through FSDP, other messages each; (): taken to
    hold for any."""

    @classmethod
    def from_errors(cls, errors: list[float], *, benchmark: str, command: str, covers: tuple[str, ...] = (),
                    layouts: tuple[str, ...] = (), zero: tuple[int, ...] = ()) -> Band:
        """The band of signed relative errors ``errors`` (at least one), of rows run on ``covers``
        in ``layouts`` at the ZeRO levels ``zero``."""
        absolute = sorted(abs(e) for e in errors)
        middle = len(absolute) // 2
        median = absolute[middle] if len(absolute) % 2 else (absolute[middle - 1] + absolute[middle]) / 2
        return cls(median=median, worst=absolute[-1], rows=len(absolute), benchmark=benchmark, command=command,
                   date=datetime.date.today().isoformat(), covers=tuple(sorted(covers)),
                   layouts=tuple(sorted(set(layouts))), zero=tuple(sorted(set(zero))))

    def holds_for(self, device: str, dtype: str) -> bool:
        """Whether the band was measured on ``device`` in ``dtype`` (any, for one of the machine at hand)."""
        return not self.covers or f"{device}/{dtype}" in self.covers

    def holds_for_layout(self, layout: str) -> bool:
        """Whether the band's rows ran plans of ``layout`` (`layout_of`)."""
        return not self.layouts or layout in self.layouts

    def holds_for_zero(self, level: int) -> bool:
        """Whether the band's rows ran plans of ZeRO level ``level``."""
        return not self.zero or level in self.zero


def layout_of(plan: Plan) -> str:
    """The dimensions a plan splits over, as bands record them: "pp", "pp+dp", "tp+dp", ...; a
    single rank is a pipeline of one stage ("pp")."""
    split = [dim for dim in ("pp", "tp", "dp") if plan.mesh[dim] > 1]
    return "+".join(split) if split and split != ["pp"] else "pp"


@dataclass(frozen=True, kw_only=True)
class Basis:
    """What a prediction rests on (``what``) and the band measured for that basis, if any."""

    key: str
    what: str
    device: str = ""  # the device compiled for, whose bands alone hold (`Band.covers`)
    band: Band | None = None
    zero3_band: Band | None = None
    """The band of this basis over ZeRO-3 plans alone, where a benchmark measured one (`FULLY_SHARDED`)."""
    layout_bands: dict[str, Band] = field(default_factory=dict)
    """The bands of this basis over one layout's rows alone, by layout (`OF_LAYOUT`)."""

    def describe(self) -> str:
        """The parenthesis printed after a predicted step."""
        if self.band is None:
            return f"({self.what}; no benchmark has measured the error of this basis yet)"
        return (f"({self.what}; {self.band.benchmark}: median {self.band.median:.0%}, "
                f"worst {self.band.worst:.0%})")


def load_bands(path: Path | None = None) -> dict[str, Band]:
    """The bands in ``path`` (default: the shipped file) by basis key; {} when there is none."""
    path = path or ACCURACY_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot be read as JSON ({error}); rerun the benchmark that writes it") from None
    try:
        return {key: Band(**{**value, **{name: tuple(value.get(name, ())) for name in ("covers", "layouts", "zero")}})
                for key, value in data.items()}
    except TypeError as error:
        raise ConfigError(f"{path}: not a table of bands ({error}); rerun the benchmark that writes it") from None


def write_band(key: str, band: Band, path: Path | None = None) -> Path:
    """Record ``band`` under ``key`` in ``path`` (default: the shipped file), keeping the other keys."""
    path = path or ACCURACY_FILE
    data = {name: asdict(value) for name, value in load_bands(path).items()}
    data[key] = asdict(band)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def band_key(kind: str, local: str | None) -> str:
    """The key of a basis ``kind`` on a device that is the machine at hand (``local``: "cpu",
    "cuda") or a named spec (None): bands are measured per kind of machine."""
    return f"{local or 'spec'}-{kind}"


def basis_for(*, device: str, local: str | None, measured: bool, costs: Path | None, messages: bool,
              pipeline: bool = False, co_run: int = 1, ranks_on_host: int = 1,
              bands: dict[str, Band] | None = None, costs_hosts: tuple[str, ...] = ()) -> Basis:
    """The basis of a compile for ``device``: ``measured`` when the default path measured its ops
    here, ``costs`` the cost database given instead, ``messages`` whether this machine's message
    figures were measured, ``pipeline`` whether the plan ran here first (``--profile-pipeline``,
    or the default compile of a layout given in full for this CPU),
    ``co_run`` the processes the model's compute was timed among (the host's ranks that compute
    at once, one per core at most: `autopart.profiling.co_run`; 1: alone), ``ranks_on_host`` the
    plan's ranks on this host (more than ``co_run`` where they outnumber its cores), ``costs_hosts``
    the hosts the ``costs`` database records its figures measured on: named where one is not this
    machine (a file copied from another machine's CPU reads as this one's, its keys name no host)."""
    bands = load_bands() if bands is None else bands
    on = "this pipeline, " if pipeline else ""
    beside = "" if pipeline else _timed_among(co_run, ranks_on_host)
    if measured:
        ops = "ops, this pipeline" if pipeline else f"ops{beside}"
        kind = MEASURED_PIPELINE if pipeline else MEASURED
        what = f"{ops} and messages measured on this machine" if messages else \
            f"{ops} measured on this machine, messages from the device spec"
    elif costs is not None:
        kind = PROFILED
        elsewhere = set(costs_hosts) - {socket.gethostname()}
        source = f"{costs.name}, measured on {', '.join(sorted(costs_hosts))}" if elsewhere else costs.name
        what = f"ops from {source}{beside}, {on}messages " + ("measured on this machine" if messages else "from the spec")
    elif local is not None:
        kind, what = ROOFLINE, f"{device} roofline: nothing measured (--no-measure)"
    else:
        kind, what = ROOFLINE, f"{device} roofline"
    key = band_key(kind, local)
    layout_bands = {name.partition(OF_LAYOUT)[2]: band for name, band in bands.items()
                    if name.partition(OF_LAYOUT)[0] == key and OF_LAYOUT in name}
    return Basis(key=key, what=what, device=device, band=bands.get(key), zero3_band=bands.get(key + FULLY_SHARDED),
                 layout_bands=layout_bands)


def _timed_among(co_run: int, ranks_on_host: int) -> str:
    """How the ops were timed beside the host's other ranks. Ranks that outnumber the cores take
    turns on them: the timing runs one process per core, and the step model shares the cores out
    (`autopart.schedule.shared`: each busy rank at cores / busy of its speed, with a cold cache's
    price per turn), which docs/first_run.md checks against runs of four ranks on two cores."""
    if ranks_on_host > co_run:
        cores = f"{co_run} core{'s' if co_run > 1 else ''}"
        return (f" (timed {co_run} at once, one per core; the plan's {ranks_on_host} ranks on this host take turns "
                f"on its {cores}, as the step counts them)")
    return f" (timed {co_run} at once, as the plan's ranks on this host compute)" if co_run > 1 else ""


def with_basis(plan: Plan, basis: Basis) -> Plan:
    """``plan`` with its prediction's basis and band recorded (``plan.predicted``): a ZeRO-3
    plan's the band of the ZeRO-3 rows, where one was measured, any other's that of its layout's
    rows (`OF_LAYOUT`), where there is one apart from the basis's; none where the band's rows ran on
    other devices or in another precision than the plan's; none, naming the benchmark, where its
    rows ran other layouts (`Band.layouts`) or, where replicas reduce gradients, other ZeRO levels
    (`Band.zero`)."""
    key, band, layout = basis.key, basis.band, layout_of(plan)
    if plan.zero == 3 and basis.zero3_band is not None:
        key, band = key + FULLY_SHARDED, basis.zero3_band
    elif layout in basis.layout_bands:
        key, band = f"{key}{OF_LAYOUT}{layout}", basis.layout_bands[layout]
    if band is not None and not band.holds_for(basis.device, plan.dtype):
        band = None  # measured on other devices or in another precision: no band for this one
    benchmark = "" if band is None else band.benchmark
    rows = benchmark if benchmark.endswith(" rows") else f"{benchmark}'s rows"  # "published_runs, its ZeRO-3 rows"
    if band is not None and not band.holds_for_layout(layout):  # `describe_prediction` says so
        *others, last = sorted({*band.layouts, *basis.layout_bands})
        ran = f"{', '.join(others)} and {last}" if others else last
        benchmark, band = f"{rows} ran {ran} plans alone", None
    if band is not None and plan.mesh["dp"] > 1 and not band.holds_for_zero(plan.zero):  # other messages
        benchmark, band = f"{rows} ran {' and '.join(f'ZeRO-{z}' for z in band.zero)} plans alone", None
    predicted = replace(plan.predicted, basis=basis.what, basis_key=key,
                        error_median=None if band is None else band.median,
                        error_worst=None if band is None else band.worst,
                        error_benchmark=benchmark)
    return replace(plan, predicted=predicted)


MFU_CEILING = 0.55
"""About the most model FLOPs utilisation that published dense 16-bit training runs reach
(MegaScale's 175B on 256 GPUs, 55.2% by its own count, 53.0% by benchmarks/published_runs.py's;
NVIDIA's GPT-3 175B recipe on H100s 53.7%): a step the models give that implies more rests on
kernel efficiencies the device does not reach for that model, and a 16-bit plan's predicted step
is bounded by it (`autopart.solve.assemble`), saying so."""


def ceiling_step_s(cost_model: Any, dtype: str | None, devices: int, flops: float, peak: float) -> float:
    """The shortest step a 16-bit plan on an accelerator's roofline can take: its model FLOPs at
    `MFU_CEILING` of its ``devices``' dense ``peak``. The roofline's kernel efficiencies are each a
    matrix product's alone, at full clocks, with no other kernel beside it; for some models (wide,
    few layers) they sum to a step no published dense 16-bit run has come near, which is not a
    prediction. 0 for fp32 and the CPU, which no such run bounds, and for ops measured on the
    device, which say what it did."""
    roofline = cost_model.name.startswith("roofline:")
    if not roofline or cost_model.device.kind == "cpu" or not (dtype or "fp32").startswith("bf16") or peak <= 0:
        return 0.0
    return flops / (devices * peak * MFU_CEILING)


def implied_mfu(plan: Plan) -> float:
    """The model FLOPs utilisation a plan's predicted step implies (0 where it records no FLOPs)."""
    predicted = plan.predicted
    if predicted.step_s <= 0 or predicted.peak_flops <= 0:
        return 0.0
    return predicted.model_flops_per_step / (predicted.step_s * plan.world_size * predicted.peak_flops)


def mfu_clause(plan: Plan) -> str:
    """", MFU 44.1%" after the predicted step of a 16-bit plan for an accelerator (its roofline or
    its measured ops): the figure Megatron, torchtitan and the papers report, so a user compares
    the plan with their runs in their own terms. "" for the CPU (its peak is a matrix product
    measured here, which no published run is held to), for fp32 (its peak is not the one those
    figures are of), and where the step is the MFU ceiling's (`describe_prediction` says so)."""
    if plan.provenance.device_kind in ("", "cpu") or not plan.dtype.startswith("bf16"):
        return ""  # "" also for a plan written before it recorded its device's kind
    if plan.predicted.unbounded_step_s is not None:
        return ""
    mfu = implied_mfu(plan)
    return f", MFU {mfu:.1%}" if mfu > 0 else ""


def describe_prediction(plan: Plan) -> str:
    """The parenthesis after a recorded plan's predicted step: its basis and band as the plan
    records them ("" for a plan written before they were recorded), and where the step is the
    `MFU_CEILING`'s, what the models gave beneath it."""
    predicted = plan.predicted
    if not predicted.basis:
        return ""
    if predicted.error_median is None and predicted.error_benchmark:  # a band of other layouts (`with_basis`)
        of = f"ZeRO-{plan.zero}" if re.search(r" ran ZeRO-\d", predicted.error_benchmark) else layout_of(plan)
        text = f" ({predicted.basis}; no band for {of} plans: {predicted.error_benchmark})"
    else:
        band = None if predicted.error_median is None else Band(
            median=predicted.error_median, worst=predicted.error_worst, rows=0, benchmark=predicted.error_benchmark,
            command="", date="")
        text = " " + Basis(key=predicted.basis_key, what=predicted.basis, band=band).describe()
    if predicted.unbounded_step_s is not None:
        unbounded = replace(plan, predicted=replace(predicted, step_s=predicted.unbounded_step_s))
        text += (f"; bounded by the ~{MFU_CEILING:.0%} MFU that the best published dense 16-bit runs reach, where the "
                 f"device's kernel efficiencies alone gave {predicted.unbounded_step_s * 1e3:.3f} ms, "
                 f"{implied_mfu(unbounded):.0%} MFU")
    return text
