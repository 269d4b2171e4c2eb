"""``autopart profile-comm``: measure messages and collectives between processes on this machine.

Starts ``ranks`` processes (gloo on loopback here, forked as the compile's other runs here are,
`autopart.tools.local_run.run_here`; NCCL on GPUs, spawned) and times, at a few sizes, a
point-to-point message in the runtime's own pattern (``isend``/``irecv`` then ``wait``, one-way
time as half a round trip), ``all_reduce``, ``all_gather`` and ``reduce_scatter``; median of
repeats. Of a message's time it also measures the part that is the two processes' own work,
which a rank cannot spend computing (``p2p_send_cpu``, ``p2p_recv_cpu``): the CPU time of the
sender's ``isend`` and its ``wait`` and of the receiver's ``irecv().wait()`` on the calling
thread, each with what gloo's communication threads spent per message, measured as a pipeline
sends: between milliseconds of compute, the message already there when it is received (on a CPU
as much as a small layer's forward, and far more than back to back, with gloo's code and state
hot in the caches). On a GPU the host's part
is not the device's time: those curves stay out. Last, on a CPU, what a message takes longer
when every core is busy (``p2p_busy_delay``: the mean one-way time with one spinning process
per core, less the mean without): its receiver waits to be scheduled, up to a scheduler
slice, which is what ranks that outnumber the cores pay on every message that finds the cores
taken.
And what waking costs (``wake``, extra seconds by idle seconds): a rank blocked on a message
leaves its core idle, and on a virtual machine its next work then runs slower for a while
(the host hands an idle virtual core's physical core to other work, whose state the caches and
predictors then hold). And how much slower compute runs inside a running
pipeline than alone (``pipeline_compute``, one factor): both ranks compute a tiny layer at once
while each one's message lands mid-compute on the other, against the same chunks run alone in
turn (a lower bound: a real stage's forward and backward slow down more than a tiny layer,
which ``autopart compile --profile-pipeline`` measures per model). It also reads each process's
resident memory after it has imported the runtime and joined the group and run one step of a
tiny model: the memory every rank takes besides its model's own tensors.

The result is cached next to the CPU calibration (``$AUTOPART_CACHE_DIR``), per host, backend
and torch version; ``load_device`` puts it into the spec of the device it was measured on, so
that the cost model's ``p2p_time`` and ``collective_time`` answer measured figures, interpolated
between the measured sizes (gloo's time per message is no straight line in its size: small
messages go out at once, larger ones pay a fixed rendezvous first).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from autopart.ir.errors import ConfigError
from autopart.tools.local_run import free_port, run_here
from cost_models.resident import resident_bytes
from cost_models.calibration import cache_dir, cache_slug, usable_cores, writable_cache_dir, write_json

__all__ = ["CommProfile", "Effort", "FULL", "QUICK", "cache_path", "profile_comm", "load_comm_profile", "SIZES", "WAKE_IDLES"]

SIZES = (4, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 8 << 20)
"""Message sizes timed, in bytes: latency-bound to bandwidth-bound."""
_REPEATS = 15
_KINDS = ("p2p", "all_reduce", "all_gather", "reduce_scatter")
_TIMEOUT_S = 600.0  # a run on the CPU that takes longer is stuck (FULL takes tens of seconds)
WAKE_IDLES = (0.0005, 0.001, 0.003, 0.01, 0.03)
"""Seconds a rank is kept waiting before its work is timed, for the wake curve."""
_CPU_KINDS = ("p2p_send_cpu", "p2p_recv_cpu")
_BETWEEN_MESSAGES_S = 0.002
"""Seconds of compute around each message whose CPU cost is measured (``_p2p_cpu``)."""
_CPU_REPEATS = 40
"""Messages timed per size for ``_p2p_cpu``: on a shared virtual machine one side's figure moves
severalfold between small sets of messages, so the trimmed mean needs many."""


@dataclass(frozen=True, kw_only=True)
class Effort:
    """How many samples each measurement takes: ``autopart profile-comm`` takes `FULL`; the
    default compile, which measures only when the cache lacks a profile, takes `QUICK` so that a
    first compile stays within seconds (its medians rest on fewer samples, and a later
    ``profile-comm`` replaces them)."""

    repeats: int = _REPEATS
    cpu_repeats: int = _CPU_REPEATS
    round_trips: int = 200
    wake_rounds: int = 30
    compute_rounds: int = 30


FULL = Effort()
QUICK = Effort(repeats=5, cpu_repeats=12, round_trips=60, wake_rounds=8, compute_rounds=8)


@dataclass(frozen=True, kw_only=True)
class CommProfile:
    device: str
    backend: str
    ranks: int
    host: str
    torch_version: str
    curves: dict[str, list[list[float]]]
    """Per kind, [bytes, seconds] points; collectives at ``ranks`` processes."""
    process_bytes: int
    """Resident memory of one rank after importing the runtime and joining the group."""

    def describe(self) -> str:
        lines = [f"{self.backend}, {self.ranks} processes on {self.host} ({self.device}):"]
        for kind, points in self.curves.items():
            if kind == "wake":
                cells = ", ".join(f"{idle * 1e3:.1f} ms idle +{s * 1e6:.0f} us" for idle, s in points)
            elif kind == "pipeline_compute":
                cells = f"x{points[0][1]:.3f} of compute alone"
            else:
                cells = ", ".join(f"{int(b)} B {s * 1e6:.0f} us" for b, s in points)
            lines.append(f"  {kind:15s} {cells}")
        lines.append(f"  memory of one rank before the model: {self.process_bytes / 2**20:.0f} MiB")
        return "\n".join(lines)


def cache_path(device: str, backend: str) -> Path:
    """Where the profile of ``device`` over ``backend`` is cached, per host and torch version."""
    return cache_dir() / f"comm-{cache_slug(f'{socket.gethostname()}-{device}-{backend}-torch{torch.__version__}')}.json"


def load_comm_profile(device: str) -> CommProfile | None:
    """The cached measurements for ``device`` on this host and torch, or None."""
    backend = "nccl" if device != "cpu" else "gloo"
    try:  # one edited by hand or cut short is measured again, as one that is not JSON: not a traceback later
        profile = CommProfile(**json.loads(cache_path(device, backend).read_text()))
        figures = [float(x) for curve in profile.curves.values() for size, s in curve for x in (size, s)]
        figures.append(float(profile.process_bytes))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None
    return profile if all(0 <= x < math.inf for x in figures) else None


def _time(call, device: torch.device, repeats: int = _REPEATS) -> float:
    import torch.distributed as dist

    samples = []
    for i in range(repeats + 2):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _helper_threads_cpu() -> float:
    """CPU seconds so far of this process's threads other than the calling one (gloo's)."""
    import threading

    own = threading.get_native_id()
    total = 0
    for task in os.listdir("/proc/self/task"):
        if int(task) != own:
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
    return total / 1e9


def _p2p_cpu(rank: int, buffer: torch.Tensor, repeats: int = _CPU_REPEATS) -> tuple[float, float]:
    """(send, receive) CPU seconds of one message, rank 0 sending and rank 1 receiving, as a
    pipeline sends them: between milliseconds of compute (a tiny layer), so that gloo's code
    and state are out of the caches, and with the message already there when the receiver asks
    for it. Each side is the calling thread's time in ``isend`` and its ``wait`` or in
    ``irecv().wait()``, plus what the process's other threads (gloo's) spent meanwhile: the
    trimmed mean over ``_CPU_REPEATS`` messages. Back to back, hot, a message costs far less,
    which is not what a pipeline's messages see."""
    import torch.distributed as dist

    from autopart.profiling.in_situ import trimmed_mean

    layer = _TinyLayer(torch.device("cpu"))
    received = torch.empty_like(buffer)
    done = torch.zeros(1)
    sides: list[float] = []  # per message: the calling thread's CPU and gloo's threads' CPU meanwhile
    dist.barrier()
    for i in range(repeats + 2):
        layer.run_for(_BETWEEN_MESSAGES_S)
        helpers = _helper_threads_cpu()
        if rank == 0:
            start = time.thread_time()
            work = dist.isend(buffer, 1)
            spent = time.thread_time() - start
            layer.run_for(_BETWEEN_MESSAGES_S)
            start = time.thread_time()
            work.wait()
            spent += time.thread_time() - start
        elif rank == 1:
            layer.run_for(2 * _BETWEEN_MESSAGES_S)  # the message arrives meanwhile
            start = time.thread_time()
            dist.irecv(received, 0).wait()
            spent = time.thread_time() - start
        if i >= 2:
            sides.append(spent + _helper_threads_cpu() - helpers)
        (dist.irecv if rank == 0 else dist.isend)(done, 1 - rank).wait()
    own = trimmed_mean(sides)
    receiver = _rank_1s(own, rank)
    return (own, receiver) if rank == 0 else (0.0, own)


def _rank_1s(figure: float, rank: int) -> float:
    """Rank 1's ``figure``, on rank 0 (which writes the curves) and on rank 1 itself."""
    import torch.distributed as dist

    value = torch.tensor([figure], dtype=torch.float64)
    if rank == 1:
        dist.send(value, 0)
    else:
        dist.recv(value, 1)
    return value.item()


def _busy_delay(rank: int, round_trips: int = 200) -> float:
    """Mean one-way time of a small message with a spinning process on every core, less without
    (ranks past the first two only wait)."""
    import subprocess
    import sys

    import torch.distributed as dist

    buffer = torch.zeros(1)

    def mean_one_way() -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(round_trips if rank < 2 else 0):
            if rank == 0:
                dist.isend(buffer, 1).wait()
                dist.irecv(buffer, 1).wait()
            else:
                dist.irecv(buffer, 0).wait()
                dist.isend(buffer, 0).wait()
        return (time.perf_counter() - start) / round_trips / 2

    idle = mean_one_way()
    spinners = []
    if rank == 0:
        cores = usable_cores()
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
        time.sleep(0.3)  # until they spin
    try:
        busy = mean_one_way()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    dist.barrier()
    return max(0.0, busy - idle)


class _TinyLayer:
    """A tiny Transformer layer: embedding, norm, attention, head, cross-entropy; fp32."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(64, 32).to(device)
        self.norm = torch.nn.LayerNorm(32).to(device)
        self.linear = torch.nn.Linear(32, 96).to(device)
        self.head = torch.nn.Linear(32, 64).to(device)
        self.tokens = torch.randint(0, 64, (2, 16), device=device)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in (self.embedding, self.norm, self.linear, self.head) for p in m.parameters()]

    def step(self) -> None:
        """One forward and backward (the gradients accumulate)."""
        from torch.nn import functional as F

        x = self.norm(self.embedding(self.tokens))
        q, k, v = self.linear(x).view(2, 16, 3, 4, 8).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        logits = self.head(F.gelu(y.transpose(1, 2).reshape(2, 16, 32)) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)))
        F.cross_entropy(logits.reshape(-1, 64), self.tokens.reshape(-1)).backward()

    def run_for(self, seconds: float) -> None:
        """Steps until ``seconds`` have passed: a rank's compute between messages."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.step()


def _warm_up(device: torch.device) -> None:
    """One training step of a tiny Transformer layer, so that the memory read afterwards holds
    what any training rank holds besides its model: the library code that ops page in, the
    allocator's arenas, the autograd engine and the optimizer."""
    layer = _TinyLayer(device)
    optimizer = torch.optim.AdamW(layer.parameters(), foreach=False)
    layer.step()
    optimizer.step()


def _wake_curve(rank: int, rounds: int = 30) -> list[list[float]]:
    """[idle seconds, extra seconds] at each of `WAKE_IDLES`, on rank 1 (empty elsewhere).

    Rank 0 computes for the idle time and then sends; rank 1, blocked in the receive meanwhile,
    times 24 steps of a tiny layer once it has the message: what the first 12 take beyond as
    many of the last eight, hot again, is what waking cost (ranks past the first two only wait).
    The slowness outlasts the first few steps, so counting over only three against the next
    three would miss part of it."""
    import torch.distributed as dist

    layer = _TinyLayer(torch.device("cpu"))
    flag = torch.zeros(1)
    measured: dict[float, list[tuple[float, float]]] = {idle: [] for idle in WAKE_IDLES}
    for _ in range(rounds):
        for idle in WAKE_IDLES:
            dist.barrier()
            if rank == 0:
                layer.run_for(idle)
                dist.isend(flag, 1).wait()
                dist.irecv(flag, 1).wait()
            elif rank == 1:
                posted = time.perf_counter()
                dist.irecv(flag, 0).wait()
                waited = time.perf_counter() - posted
                calls = []
                for _ in range(24):
                    start = time.perf_counter()
                    layer.step()
                    calls.append(time.perf_counter() - start)
                measured[idle].append((waited, sum(calls[:12]) - 12 * statistics.median(calls[16:])))
                dist.isend(flag, 0).wait()
    return [[statistics.median(w for w, _ in points), max(0.0, statistics.median(e for _, e in points))]
            for points in measured.values() if points]


def _pipeline_compute(rank: int, rounds: int = 30, steps: int = 8, nbytes: int = 262144) -> float:
    """How much slower compute runs inside a running pipeline than alone (rank 0's answer; the
    mean over the two ranks; ranks past the first two only wait).

    In the pipeline both ranks compute chunks of ``steps`` tiny-layer steps at once, and each
    sends the other a message of ``nbytes`` halfway through its chunk, so that it lands while
    the peer computes, as a pipeline's activations and gradients do; alone, each rank runs the
    same chunks while the other waits. The first two steps of a chunk are left out (waking, its
    own curve). Each round compares the two a fraction of a second apart (the trimmed means of
    its steps), and the answer is the median over the rounds: this machine's speed moves more
    than the effect between rounds (a ratio of whole-run means gave 1.0 to 1.27 in a row)."""
    import torch.distributed as dist

    from autopart.profiling.in_situ import trimmed_mean

    layer = _TinyLayer(torch.device("cpu"))
    message, inbox = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)

    def chunk(samples: list[float], exchange: bool) -> None:
        pending = [dist.irecv(inbox, 1 - rank)] if exchange else []
        for i in range(steps):
            if exchange and i == steps // 2:
                pending.append(dist.isend(message, 1 - rank))
            start = time.perf_counter()
            layer.step()
            if i >= 2:
                samples.append(time.perf_counter() - start)
        for work in pending:
            work.wait()

    ratios = []
    for _ in range(rounds):
        together: list[float] = []
        alone: list[float] = []
        dist.barrier()
        for _ in range(4 if rank < 2 else 0):
            chunk(together, exchange=True)
        for turn in (0, 1):
            dist.barrier()
            if rank == turn:
                for _ in range(4):
                    chunk(alone, exchange=False)
        if rank < 2:
            ratios.append(trimmed_mean(together) / trimmed_mean(alone))
    dist.barrier()
    if rank >= 2:
        return 1.0
    ratio = statistics.median(ratios)
    other = _rank_1s(ratio, rank)
    return max(1.0, (ratio + other) / 2) if rank == 0 else ratio


def _worker(rank: int, ranks: int, backend: str, port: int, out: str, effort: Effort = FULL,
            zygote: int | None = None) -> None:
    import warnings

    import torch.distributed as dist

    # torch renames the *_tensor collectives; the old names are the ones every supported torch has
    warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)

    import autopart.runtime.train  # noqa: F401 - the runtime's imports are part of its memory

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    dist.barrier()
    _warm_up(device)
    process_bytes = resident_bytes(zygote)
    curves: dict[str, list[list[float]]] = {kind: [] for kind in _KINDS + (_CPU_KINDS if backend == "gloo" else ())}
    for nbytes in SIZES:
        buffer = torch.zeros(max(1, nbytes // 4), device=device)

        def ping_pong() -> None:
            if rank == 0:
                dist.isend(buffer, 1).wait()
                dist.irecv(buffer, 1).wait()
            elif rank == 1:
                dist.irecv(buffer, 0).wait()
                dist.isend(buffer, 0).wait()

        curves["p2p"].append([nbytes, _time(ping_pong, device, effort.repeats) / 2])
        if backend == "gloo" and rank < 2:
            send, receive = _p2p_cpu(rank, buffer, effort.cpu_repeats)
            curves["p2p_send_cpu"].append([nbytes, send])
            curves["p2p_recv_cpu"].append([nbytes, receive])
        elif backend == "gloo":
            dist.barrier()  # ranks past the pair only join the pair's barrier
        curves["all_reduce"].append([nbytes, _time(lambda: dist.all_reduce(buffer), device, effort.repeats)])
        part = torch.zeros(max(1, nbytes // 4 // ranks), device=device)
        whole = torch.zeros(part.numel() * ranks, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch's names
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        curves["all_gather"].append([nbytes, _time(lambda: gather(whole, part), device, effort.repeats)])
        try:
            curves["reduce_scatter"].append([nbytes, _time(lambda: scatter(part, whole), device, effort.repeats)])
        except (RuntimeError, NotImplementedError, ValueError):
            pass  # a backend without reduce_scatter: the cost model keeps its formula for it
    if backend == "gloo":
        delay = _busy_delay(rank, effort.round_trips)
        if rank == 0:
            curves["p2p_busy_delay"] = [[1, delay]]
        wake = [_wake_curve(rank, effort.wake_rounds)]
        dist.broadcast_object_list(wake, src=1)
        factor = _pipeline_compute(rank, effort.compute_rounds)
        if rank == 0:
            curves["wake"] = sorted(wake[0])
            curves["pipeline_compute"] = [[1, factor]]
    dist.destroy_process_group()
    for points in curves.values():  # a smaller message never takes longer than a larger one
        for i in range(len(points) - 2, -1, -1):
            points[i][1] = min(points[i][1], points[i + 1][1])
    if rank == 0:
        Path(out).write_text(json.dumps({"curves": {k: v for k, v in curves.items() if v},
                                         "process_bytes": process_bytes}))


def _spawn(ranks: int, backend: str, out: str, effort: Effort) -> None:
    import torch.multiprocessing as mp

    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun starts every rank
    try:
        mp.start_processes(_worker, args=(ranks, backend, free_port(), out, effort), nprocs=ranks, join=True,
                           start_method="spawn")
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def profile_comm(*, ranks: int = 2, backend: str | None = None, effort: Effort = FULL) -> tuple[CommProfile, Path]:
    """Measure with ``ranks`` processes and ``effort`` samples, cache the result, return it and where it went."""
    from cost_models.device_names import local_device_name

    if ranks < 2:
        raise ConfigError(f"--ranks must be at least 2 to measure communication, got {ranks}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"--backend must be gloo or nccl, got {backend!r}")
    if backend == "nccl" and (visible := torch.cuda.device_count()) < ranks:  # fewer than 2: 2 ranks are the fewest
        fix = "use fewer --ranks" if visible > 1 else "use --backend gloo for this machine's CPU, or a machine of 2 GPUs"
        raise ConfigError(f"nccl over {ranks} ranks needs {ranks} GPUs, {visible} visible; {fix}")
    cores = usable_cores()
    if backend == "gloo" and ranks > max(2, cores):  # each rank is a process here: a typo was a fork bomb
        raise ConfigError(f"--ranks {ranks} would start {ranks} processes on this machine's {cores} core"
                          f"{'s' * (cores > 1)}, where ranks past one per core measure the cores taking turns, not "
                          f"the links; use --ranks {max(2, cores)} or fewer")
    device = local_device_name("cuda" if backend == "nccl" else "cpu")
    writable_cache_dir()  # before the seconds of measuring, not after them
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "comm.json")
        if backend == "gloo":  # forked, as the compile's other runs here: no rank imports torch again
            run_here(["-m", __spec__.name, backend, out, json.dumps(asdict(effort))], ranks, timeout_s=_TIMEOUT_S)
        else:  # CUDA cannot be forked into
            _spawn(ranks, backend, out, effort)
        data = json.loads(Path(out).read_text())
    profile = CommProfile(device=device, backend=backend, ranks=ranks, host=socket.gethostname(),
                          torch_version=torch.__version__, **data)
    path = cache_path(device, backend)
    write_json(path, asdict(profile), indent=1)  # compiles on this host read it: never half a file
    return profile, path


if __name__ == "__main__":  # a rank of `profile_comm`'s run on the CPU, with torchrun's variables
    _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1], int(os.environ["MASTER_PORT"]),
            sys.argv[2], Effort(**json.loads(sys.argv[3])), zygote=os.getppid())
