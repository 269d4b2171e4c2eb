"""The interface the compiler sees: seconds for kernels and for communication.

The annotate pass, the tensor-parallel sharder and the solver ask a `CostModel` how long
things take and never look at a device name or a datasheet figure; a profiled model, an
analytical one or a mix of both can stand behind the same four questions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from cost_models.counting import Kernel
from cost_models.database import CoRunMeasurement, OpTimes, PipelineMeasurement, RuntimeOverheads
from cost_models.devices import DeviceSpec

__all__ = ["CostModel"]


@runtime_checkable
class CostModel(Protocol):
    """Predicted seconds on one device of a cluster.

    Collectives follow nccl-tests' convention (see `cost_models.comm`):
    ``time = latency_per_step · steps + nbytes · factor / bus_bandwidth``, with factor
    2(n−1)/n for all_reduce, (n−1)/n for all_gather, reduce_scatter and all_to_all, and 1 for
    broadcast; a group of one rank costs 0 s.
    """

    @property
    def name(self) -> str:
        """Identifies the model and device in a plan's provenance, e.g. ``"roofline:h100-sxm"``."""
        ...

    @property
    def device(self) -> DeviceSpec:
        ...

    def kernel_time(self, kernel: Kernel) -> float:
        """Seconds one kernel takes, launch overhead included."""
        ...

    def kernels_time(self, kernels: Iterable[Kernel]) -> float:
        """Seconds a sequence of kernels takes, run one after another on one stream."""
        ...

    def op_times(self, op_key: str, forward: Sequence[Kernel], backward_input: Sequence[Kernel],
                 backward_weight: Sequence[Kernel]) -> OpTimes:
        """Seconds of one graph node: measured when the database has ``op_key``, else from its kernels."""
        ...

    def optimizer_time(self, optimizer: str, parameters: Iterable[tuple[tuple[int, ...], str]]) -> float:
        """Seconds of one optimizer step over parameters given as (shape, dtype)."""
        ...

    @property
    def runtime_overheads(self) -> RuntimeOverheads:
        """Fixed costs per forward and per backward action that no op carries."""
        ...

    def p2p_time(self, nbytes: float, *, across_nodes: bool = False) -> float:
        """Seconds to send ``nbytes`` from one device to another (pipeline send and receive)."""
        ...

    def p2p_rank_time(self, nbytes: float, *, across_nodes: bool = False) -> tuple[float, float]:
        """(sender, receiver) seconds of rank time within one message's `p2p_time`: the work the
        two processes do themselves (posting, completing, their communication threads), which
        takes a core from their compute; the rest of `p2p_time` is latency."""
        ...

    def p2p_busy_delay(self) -> float:
        """Seconds a message takes longer when every core is busy: the receiving process (and
        its communication threads) wait to be scheduled. 0 where not measured."""
        ...

    def wake_time(self, idle_s: float) -> float:
        """Seconds a rank's work takes longer after its core sat idle ``idle_s`` seconds (it
        waited for a message): the core warms up again. 0 where not measured."""
        ...

    def pipeline_compute_factor(self) -> float:
        """How many times longer a rank's compute takes inside a running pipeline than alone:
        the other ranks compute beside it and their messages land mid-compute (shared caches,
        the communication threads). 1 where not measured."""
        ...

    def pipeline_profile(self, pipeline: str) -> PipelineMeasurement | None:
        """What one pipeline measured as it ran (``autopart compile --profile-pipeline``;
        ``pipeline`` is its `autopart.profiling.pipeline.pipeline_key`): its compute factor, which
        holds the waking after waits and the sharing of cores too, and its tied gradients' sum.
        None where not measured."""
        ...

    def co_run(self, key: str) -> CoRunMeasurement | None:
        """How much slower the model computed with the host's other ranks computing beside it
        (``key``: `autopart.profiling.co_run.co_run_key`). None where not measured."""
        ...

    def collective_time(self, kind: str, nbytes: float, group_size: int, *, nodes: int = 1,
                        members: int | None = None) -> float:
        """Seconds for one collective over ``group_size`` ranks on ``nodes`` nodes
        (`cost_models.comm.nodes_spanned`), the fewest of them on one node ``members``
        (`cost_models.comm.fewest_members`; None: spread evenly); ``nbytes`` as in nccl-tests."""
        ...
