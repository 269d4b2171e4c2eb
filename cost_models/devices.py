"""Device specs: what one accelerator (or this CPU) can do, read from one TOML file per device.

The figures live in data files (``cost_models/devices/<name>.toml``), each stating where its
numbers come from, so that adding a device or correcting a figure is an edit to a file with a
source beside it, not to code. ``cpu`` is special: its throughput is measured on the machine at
hand the first time it is asked for (see `cost_models.calibration`), because no datasheet
describes a shared 2-core container.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from autopart.ir.errors import DeviceSpecError
from cost_models.memory import FRAMEWORK_OVERHEAD_BYTES
from cost_models.device_names import local_device_name, spec_name  # the names its specs are stored under

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "DeviceSpec", "PEAK_DTYPES", "load_device", "known_devices", "local_device_name", "spec_name", "DEVICES_DIR",
]

DEVICES_DIR = Path(__file__).resolve().parent / "devices"
PEAK_DTYPES = ("float32", "tf32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One device's throughput, memory and links, as the roofline and the solver use them."""

    name: str
    """Short name, the file's stem: ``"h100-sxm"``."""
    description: str
    """One line for reports: the part, its memory, its links."""
    kind: str
    """``"cuda"``, ``"rocm"`` or ``"cpu"``: what runtime the device needs (and its overhead)."""
    source: str
    """Where the figures come from, so that each can be checked."""
    memory_bytes: int
    """Device memory; for the CPU, the machine's physical RAM."""
    peak_flops: Mapping[str, float] = field(hash=False)
    """Dense peak FLOP/s by dtype, for each of `PEAK_DTYPES`."""
    matmul_efficiency: tuple[tuple[float, float], ...]
    """Achievable fraction of peak for a matmul of F FLOPs, as (log10 F, fraction) points,
    interpolated linearly in log10 F and held flat beyond the ends: small GEMMs cannot fill
    the machine, and even large ones stay below the datasheet peak (REFERENCE.md has published rates)."""
    memory_bandwidth: float
    """Bytes/s, datasheet (or, for the CPU, measured)."""
    memory_efficiency: float
    """Achievable fraction of `memory_bandwidth` for a streaming kernel such as a copy."""
    intra_node_bandwidth: float
    """Bytes/s per device per direction over the scale-up link (NVLink, Infinity Fabric)."""
    intra_node_latency_s: float
    """Seconds per step of a ring collective (and per message) inside a node, and per step of a
    ring over several nodes that does not cross between them."""
    inter_node_bandwidth: float
    """Bytes/s per device per direction over the scale-out network (its share of the NICs); a
    group with r members on a node crosses between nodes through r such shares (`cost_models.comm`)."""
    inter_node_latency_s: float
    """Seconds per ring step that crosses between nodes (and per message across nodes)."""
    link_efficiency: float
    """Achievable fraction of link bandwidth as nccl-tests bus bandwidth."""
    kernel_overhead_s: float
    """Fixed cost of one kernel: launch and framework dispatch."""
    overlap_compute_slowdown: float = 0.0
    """How much longer the compute takes while a collective runs beside it: the collective
    library's kernels hold SMs and memory bandwidth (0.19: the compute's 18.9% average slowdown
    measured on A100, H100, MI250 and MI210 training GPT and Llama models, arXiv 2507.03114).
    Only where collectives overlap the compute (`collectives_overlap_compute`); on a CPU the
    reductions' share of the cores is measured instead (`autopart.predict.reduction`)."""
    fp32_matmul_uses_tf32: bool = False
    """Whether fp32 matmuls run on tensor cores as TF32 (``allow_tf32``); off by default, as in
    PyTorch, so fp32 matmuls are charged at the fp32 peak."""
    cores: int = 0
    """CPU cores that the ranks of one machine share (their compute cannot overlap beyond
    it); 0 where every rank has a device of its own. Filled in for the calibrated CPU."""
    background_load: float = field(default=0.0, compare=False)
    """Other busy processes sharing `cores`, measured when the spec is loaded (CPU only)."""
    process_overhead_bytes: int = 0
    """Measured memory of one rank before the model (``autopart profile-comm``, on the CPU: its
    resident set; a GPU's is device memory, which that does not measure); 0: the estimate for
    the device's kind."""
    comm_curves: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict, hash=False)
    """Measured (bytes, seconds) per message kind inside a node (``autopart profile-comm``):
    ``p2p`` and collectives at `comm_ranks` processes; empty: the link figures' formula."""
    comm_ranks: int = 0
    """Group size at which the collectives in `comm_curves` were measured."""

    def __post_init__(self) -> None:
        # a private copy, kept a plain dict so that specs pickle, deepcopy and asdict
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        object.__setattr__(self, "comm_curves", {k: tuple((float(b), float(t)) for b, t in v)
                                                  for k, v in dict(self.comm_curves).items()})
        object.__setattr__(self, "matmul_efficiency",
                           tuple((float(x), float(y)) for x, y in self.matmul_efficiency))
        _validate(self)

    @property
    def collectives_overlap_compute(self) -> bool:
        """Whether a collective runs beside the compute (a GPU's copy engines and the collective
        library's own kernels) rather than on the cores that compute (gloo's threads on a CPU)."""
        return self.kind != "cpu"

    @property
    def slowdown_beside_collectives(self) -> float:
        """The compute's slowdown while a collective runs beside it: `overlap_compute_slowdown`
        where collectives overlap the compute, else 0 (on a CPU a reduction takes a measured share
        of the cores instead, which the step model counts apart)."""
        return self.overlap_compute_slowdown if self.collectives_overlap_compute else 0.0

    @property
    def framework_overhead_bytes(self) -> int:
        """Memory taken before the model's first byte: runtime context, library workspaces."""
        return self.process_overhead_bytes or FRAMEWORK_OVERHEAD_BYTES[self.kind]

    def measured_comm_time(self, kind: str, nbytes: float) -> float | None:
        """Seconds from `comm_curves`, linear between measured sizes and at the last
        segment's rate beyond them; None when ``kind`` was not measured."""
        points = self.comm_curves.get(kind)
        if not points:
            return None
        if nbytes <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)

    def matmul_efficiency_at(self, flops: float) -> float:
        """Achievable fraction of peak for one matmul of ``flops`` FLOPs."""
        points = self.matmul_efficiency
        if flops <= 0:
            return points[0][1]
        x = math.log10(flops)
        xs = [p[0] for p in points]
        i = bisect_right(xs, x)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class _FieldError(Exception):
    """A field is wrong; the caller adds which file it came from."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"field '{field_name}' {problem}")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise _FieldError(name, f"must be a positive number, got {value!r}")


def _fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _FieldError(name, f"must be a fraction in (0, 1], got {value!r}")


def _check(spec: DeviceSpec) -> None:
    for name in ("name", "description", "kind", "source"):
        if not isinstance(getattr(spec, name), str) or not getattr(spec, name):
            raise _FieldError(name, f"must be a non-empty string, got {getattr(spec, name)!r}")
    if spec.kind not in FRAMEWORK_OVERHEAD_BYTES:
        raise _FieldError("kind", f"must be one of {', '.join(FRAMEWORK_OVERHEAD_BYTES)}, "
                                  f"got {spec.kind!r}")
    if isinstance(spec.memory_bytes, bool) or not isinstance(spec.memory_bytes, int) \
            or spec.memory_bytes <= 0:
        raise _FieldError("memory_bytes", f"must be a positive integer, got {spec.memory_bytes!r}")
    missing = [dtype for dtype in PEAK_DTYPES if dtype not in spec.peak_flops]
    if missing:
        raise _FieldError("peak_flops", f"lacks {', '.join(missing)} (needs all of "
                                        f"{', '.join(PEAK_DTYPES)})")
    for dtype, value in spec.peak_flops.items():
        _positive(f"peak_flops.{dtype}", value)
    for name in ("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
        _positive(name, getattr(spec, name))
    for name in ("intra_node_latency_s", "inter_node_latency_s", "kernel_overhead_s"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise _FieldError(name, f"must be a number of seconds >= 0, got {value!r}")
    _fraction("memory_efficiency", spec.memory_efficiency)
    _fraction("link_efficiency", spec.link_efficiency)
    slowdown = spec.overlap_compute_slowdown
    if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 0 <= slowdown < 1:
        raise _FieldError("overlap_compute_slowdown", f"must be a fraction in [0, 1), got {slowdown!r}")
    if not isinstance(spec.fp32_matmul_uses_tf32, bool):
        raise _FieldError("fp32_matmul_uses_tf32",
                          f"must be true or false, got {spec.fp32_matmul_uses_tf32!r}")
    points = spec.matmul_efficiency
    if not points:
        raise _FieldError("matmul_efficiency", "needs at least one [log10_flops, fraction] point")
    for x, y in points:
        _fraction(f"matmul_efficiency[{x:g}]", y)
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise _FieldError("matmul_efficiency", "points must have increasing log10_flops")


def _validate(spec: DeviceSpec) -> None:
    try:
        _check(spec)
    except _FieldError as error:
        raise DeviceSpecError(f"device spec '{spec.name}': {error}; fix the spec") from error


_FIELDS = {f.name for f in fields(DeviceSpec)}
_MEASURED_ON_CPU = ("memory_bytes", "peak_flops", "matmul_efficiency", "memory_bandwidth",
                    "kernel_overhead_s")
"""Fields that ``calibrate = true`` measures, so that the file must not state them."""


def known_devices() -> list[str]:
    """Names that `load_device` accepts besides a path: the stems of the bundled TOML files."""
    return sorted(path.stem for path in DEVICES_DIR.glob("*.toml"))


def load_device(name: str) -> DeviceSpec:
    """The spec of a bundled device by name (``"h100-sxm"``), or of a ``.toml`` file by path.

    A file with ``calibrate = true`` (the bundled ``cpu.toml``) has its throughput measured on
    this machine, once per machine, torch version and thread count; later calls read the cache.
    """
    path = _resolve(name)
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:  # the second: not text at all
        raise DeviceSpecError(f"{path}: not valid TOML ({error}); fix the file") from None
    except OSError as error:
        raise DeviceSpecError(f"{path}: cannot be read ({error.strerror})") from None
    try:
        return _from_table(data, default_name=path.stem)
    except _FieldError as error:
        raise DeviceSpecError(f"{path}: {error}; fix the file") from None
    except DeviceSpecError as error:
        if isinstance(error.__cause__, _FieldError):  # raised by DeviceSpec's own validation
            raise DeviceSpecError(f"{path}: {error.__cause__}; fix the file") from None
        raise


def _resolve(name: str) -> Path:
    if name.endswith(".toml"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise DeviceSpecError(f"device file {name} does not exist; give an existing .toml "
                                  f"file or one of: {', '.join(known_devices())}")
        return path
    path = DEVICES_DIR / f"{name.lower()}.toml"
    if "/" in name or "\\" in name or not path.is_file():
        raise DeviceSpecError(f"unknown device '{name}'; known devices: "
                              f"{', '.join(known_devices())} (or give a path to a .toml file)")
    return path


def _from_table(data: dict[str, Any], *, default_name: str) -> DeviceSpec:
    data = dict(data)
    calibrate = data.pop("calibrate", False)
    if not isinstance(calibrate, bool):
        raise _FieldError("calibrate", f"must be true or false, got {calibrate!r}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise _FieldError(unknown[0], f"is not a device spec field (known: {', '.join(sorted(_FIELDS))})")
    data.setdefault("name", default_name)
    if calibrate:
        stated = [key for key in _MEASURED_ON_CPU if key in data]
        if stated:
            raise _FieldError(stated[0], "is measured when calibrate = true; remove it, "
                                         "or set calibrate = false and state every figure")
        from cost_models.calibration import background_load, calibrated_cpu_fields, usable_cores

        data.update(calibrated_cpu_fields())
        data["cores"] = usable_cores()
        data["background_load"] = background_load(data["cores"])
    from cost_models.comm_profile import load_comm_profile

    measured = load_comm_profile(data["name"])
    if measured is not None:
        data["comm_curves"] = measured.curves
        data["comm_ranks"] = measured.ranks
        if data.get("kind") == "cpu":  # the host memory of a rank: a GPU's context is the kind's estimate
            data["process_overhead_bytes"] = measured.process_bytes
    optional = {"fp32_matmul_uses_tf32", "overlap_compute_slowdown", "cores", "background_load",
                "process_overhead_bytes", "comm_curves", "comm_ranks"}
    missing = [f.name for f in fields(DeviceSpec) if f.name not in data and f.name not in optional]
    if missing:
        raise _FieldError(missing[0], "is missing")
    if not isinstance(data["peak_flops"], dict):
        raise _FieldError("peak_flops", "must be a table of dtype = FLOP/s")
    data["matmul_efficiency"] = _points(data["matmul_efficiency"])
    if isinstance(data["memory_bytes"], float) and data["memory_bytes"].is_integer():
        data["memory_bytes"] = int(data["memory_bytes"])
    return DeviceSpec(**data)


def _points(value: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list) or not all(
            isinstance(point, list) and len(point) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in point)
            for point in value):
        raise _FieldError("matmul_efficiency", "must be a list of [log10_flops, fraction] pairs")
    return tuple((float(x), float(y)) for x, y in value)


