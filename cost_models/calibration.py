"""Measuring the CPU at hand, so that the ``cpu`` device spec describes this machine.

A CPU's achievable throughput depends on its cores, its vector units, how many threads torch
uses and who else is running; no datasheet gives it. So the first time the ``cpu`` spec is
asked for, one to two seconds are spent measuring fp32 matmuls at a few sizes (which gives the
efficiency curve), a large copy (memory bandwidth) and a tiny op (per-op overhead). The result
is cached as JSON under ``$AUTOPART_CACHE_DIR`` (default ``~/.cache/autopart``), keyed by
hostname, torch version and thread count, the three things that change the answer.

Measurements taken while other processes crowd the cores come out low (a 2-thread matmul
waits for both threads to be scheduled); ``calibrate_cpu(refresh=True)`` measures again.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from autopart.ir.errors import ConfigError
from autopart.ir.machine import physical_memory_bytes  # named here too: the profiler's, the tests'

__all__ = ["CpuCalibration", "cache_dir", "writable_cache_dir", "usable_cores", "calibrate_cpu", "calibrated_cpu_fields",
           "physical_memory_bytes", "background_load"]

_SCHEMA = 1
MATMUL_SIZES = (64, 128, 256, 512, 1024)
"""Square fp32 matmuls timed: 5e5 to 2e9 FLOPs, the range where a CPU's efficiency changes."""
COPY_BYTES = 64 << 20
"""A copy this large streams through every cache level, so it measures memory, not cache."""
_SECONDS_PER_SIZE = 0.03
"""Time spent per size and sweep: about 0.5 s for the three sweeps on an idle machine."""
_GROUPS = 3
_SWEEPS = 3
_BUDGET_S = 1.5
"""Past this, measuring stops after the current group: a loaded machine gets fewer samples."""


@dataclass(frozen=True, kw_only=True)
class CpuCalibration:
    """What was measured, and for which machine; the JSON cache holds exactly this."""

    host: str
    torch_version: str
    threads: int
    matmul_rates: tuple[tuple[float, float], ...]
    """(FLOPs of one matmul, achieved FLOP/s with the per-op overhead taken out)."""
    copy_bandwidth: float
    """Bytes read plus written per second by a large tensor copy."""
    kernel_overhead_s: float
    """Time of one tiny eager op: dispatch, allocation, launch of the loop."""
    seconds_spent: float


def usable_cores() -> int:
    """The cores this process (and the ranks it starts) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOPART_CACHE_DIR") or Path.home() / ".cache" / "autopart")


def writable_cache_dir() -> Path:
    """`cache_dir`, made where it is missing: refused in one line, before anything is measured into
    it, where it cannot be (``AUTOPART_CACHE_DIR`` naming a file, a folder this user may not
    write), which otherwise failed after the measuring, with a traceback."""
    folder = cache_dir()
    named = "AUTOPART_CACHE_DIR" if os.environ.get("AUTOPART_CACHE_DIR") else "the default cache folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"this user may not write in {folder}")
    except OSError as error:
        why = "it is a file" if folder.exists() and not folder.is_dir() else (error.strerror or str(error))
        raise ConfigError(f"{named} {folder} cannot hold autopart's measurements ({why}); set AUTOPART_CACHE_DIR to a "
                          "folder you may write, or compile with --no-measure, which measures nothing") from None
    return folder


def cache_slug(text: str) -> str:
    """``text`` (a host name, a torch version, a model's stem) as part of a cache file's name."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def write_json(path: Path, data: Any, *, indent: int | None = None) -> None:
    """``data`` as ``path``'s JSON, written beside it and then put in its place: processes
    writing a cache at once never leave, nor read, half a file, and a failed write leaves none."""
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False)
    try:
        with handle:
            json.dump(data, handle, indent=indent)
            handle.write("\n")
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def _cache_path(host: str, threads: int) -> Path:
    return cache_dir() / f"cpu-{cache_slug(host)}-torch{cache_slug(torch.__version__)}-threads{threads}.json"


def calibrate_cpu(*, refresh: bool = False) -> CpuCalibration:
    """This machine's calibration: from the cache if present and valid, else measured now."""
    host, threads = socket.gethostname(), torch.get_num_threads()
    path = _cache_path(host, threads)
    if not refresh:
        cached = _read_cache(path, host=host, threads=threads)
        if cached is not None:
            return cached
    calibration = _measure(host=host, threads=threads)
    _write_cache(path, calibration)
    return calibration


def _read_cache(path: Path, *, host: str, threads: int) -> CpuCalibration | None:
    """The cached calibration, or None when absent, unreadable or for another setup."""
    try:
        data = json.loads(path.read_text())
        if data.pop("schema") != _SCHEMA:
            return None
        data["matmul_rates"] = tuple(tuple(point) for point in data["matmul_rates"])
        calibration = CpuCalibration(**data)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if (calibration.host, calibration.torch_version, calibration.threads) != (
            host, torch.__version__, threads):
        return None
    return calibration if _measured_figures(calibration) else None


def _measured_figures(calibration: CpuCalibration) -> bool:
    """Whether the cache's figures are ones a measurement gives (rates and a bandwidth above 0, an
    overhead at least 0, all finite): one edited by hand or damaged is measured again, where its
    figures failed the spec as if ``cpu.toml``'s ('fix the file')."""
    rates = calibration.matmul_rates

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf

    return (len(rates) > 0 and all(len(point) == 2 and all(number(x) and x > 0 for x in point) for point in rates)
            and number(calibration.copy_bandwidth) and calibration.copy_bandwidth > 0
            and number(calibration.kernel_overhead_s))


def _write_cache(path: Path, calibration: CpuCalibration) -> None:
    """Written atomically, so that processes calibrating at once never read half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"schema": _SCHEMA, **asdict(calibration)}, indent=2)
    except OSError:
        pass  # an unwritable cache costs a re-measurement next time, nothing more


def _best_time(run: Callable[[], Any], *, calls: int, groups: int, deadline: float) -> float:
    """Seconds per call, the best of up to ``groups`` groups: the least disturbed by other load.

    Past ``deadline`` no further group starts, so that a loaded machine shortens the
    calibration instead of stretching it.
    """
    best = math.inf
    for _ in range(groups):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        end = time.perf_counter()
        best = min(best, (end - start) / calls)
        if end > deadline:
            break
    return best


@torch.no_grad()
def _measure(*, host: str, threads: int) -> CpuCalibration:
    started = time.perf_counter()
    deadline = started + _BUDGET_S
    tiny = torch.ones(1)
    torch.add(tiny, tiny)
    overhead = _best_time(lambda: torch.add(tiny, tiny), calls=500, groups=4, deadline=deadline)

    warm = torch.randn(256, 256)
    for _ in range(5):  # wakes the thread pool and the BLAS library, which the first calls pay
        torch.mm(warm, warm)
    operands = {n: (torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)) for n in MATMUL_SIZES}
    best = dict.fromkeys(MATMUL_SIZES, math.inf)
    # Sweeps rather than one size at a time: on a shared machine a burst of someone else's load
    # then spoils one sweep of every size, not every measurement of one size.
    for sweep in range(_SWEEPS):
        if sweep > 0 and time.perf_counter() > deadline:
            break
        for n, (a, b, out) in operands.items():
            def matmul() -> None:
                torch.mm(a, b, out=out)

            once = _best_time(matmul, calls=1, groups=1, deadline=deadline)
            calls = max(1, min(100, int(_SECONDS_PER_SIZE / _GROUPS / max(once, 1e-7))))
            best[n] = min(best[n], once,
                          _best_time(matmul, calls=calls, groups=_GROUPS, deadline=deadline))
    # A smaller matmul never takes longer than a larger one; when it measured so, a burst of
    # load hit every one of its samples, and the larger size's time is the better bound.
    sizes = sorted(best)
    for smaller, larger in reversed(list(zip(sizes, sizes[1:]))):
        best[smaller] = min(best[smaller], best[larger])
    rates = []
    for n, per_call in best.items():
        flops = 2.0 * n ** 3
        rates.append((flops, flops / max(per_call - overhead, 0.1 * per_call)))

    elements = COPY_BYTES // 4
    src, dst = torch.ones(elements), torch.empty(elements)
    dst.copy_(src)  # first touch of the pages, not memory speed
    copy_time = _best_time(lambda: dst.copy_(src), calls=1, groups=5,
                           deadline=max(deadline, time.perf_counter() + 0.2))
    return CpuCalibration(
        host=host, torch_version=torch.__version__, threads=threads,
        matmul_rates=tuple(rates), copy_bandwidth=2 * COPY_BYTES / copy_time,
        kernel_overhead_s=overhead, seconds_spent=time.perf_counter() - started)


def background_load(cores: int, seconds: float = 0.3) -> float:
    """Other processes competing for this machine's cores now, in whole processes.

    Not cached: it changes from minute to minute. Per-op timings hardly see it (an op of
    microseconds is rarely preempted) while a step of many milliseconds does, so the step
    prediction needs it. On Linux it is the kernel's count of runnable tasks (``procs_running``
    in ``/proc/stat``) sampled through ``seconds``, less this thread; elsewhere it is inferred
    from the share of a core that one busy thread gets (with ``L`` others on ``C`` cores it gets
    ``C / (L + 1)``; one thread cannot tell an idle machine from one with fewer than ``C``
    others, so there it is a lower bound).

    Rounded to whole processes: a kernel thread that wakes for a moment, or the hypervisor
    taking the measuring thread's core for a few milliseconds, is no process competing for the
    step, and two compiles on a quiet machine must predict the same step.
    """
    running = _runnable_others(seconds)
    if running is None:
        running = _others_from_share(cores, seconds)
    return float(round(running))


def _runnable_others(seconds: float) -> float | None:
    """The mean count of runnable tasks other than this thread over ``seconds``; None where the
    kernel does not publish it."""
    try:
        with open("/proc/stat", "rb") as stat:
            samples = []
            started = time.perf_counter()
            while not samples or time.perf_counter() - started < seconds:
                stat.seek(0)
                line = next((line for line in stat if line.startswith(b"procs_running")), None)
                if line is None:
                    return None
                samples.append(int(line.split()[1]) - 1)  # this thread runs while it reads
                time.sleep(0.005)
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, sum(samples) / len(samples))


def _others_from_share(cores: int, seconds: float) -> float:
    start_wall, start_cpu = time.perf_counter(), time.thread_time()
    x = torch.ones(256)
    while time.perf_counter() - start_wall < seconds:
        x.mul_(1.0)
    share = (time.thread_time() - start_cpu) / (time.perf_counter() - start_wall)
    return max(0.0, cores / max(share, 1e-3) - 1.0) if share < 0.95 else 0.0


def calibrated_cpu_fields() -> dict[str, Any]:
    """The `DeviceSpec` fields that ``calibrate = true`` fills in.

    The peak is the best rate measured, so the efficiency curve is measured rate over best
    rate and reaches 1.0 at the best size. bf16, fp16 and tf32 get the fp32 figure: without
    AMX, CPUs run 16-bit matmuls no faster than fp32 (often slower), and none is measured.
    The bandwidth is the measured copy rate, hence an efficiency of 1.0 in ``cpu.toml``.
    """
    calibration = calibrate_cpu()
    peak = max(rate for _, rate in calibration.matmul_rates)
    curve = [[math.log10(flops), max(rate / peak, 1e-3)] for flops, rate in calibration.matmul_rates]
    return {
        "memory_bytes": physical_memory_bytes(),
        "peak_flops": {"float32": peak, "tf32": peak, "bfloat16": peak, "float16": peak},
        "matmul_efficiency": curve,
        "memory_bandwidth": calibration.copy_bandwidth,
        "kernel_overhead_s": calibration.kernel_overhead_s,
    }
