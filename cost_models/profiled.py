"""A `CostModel` that answers measured times where the database has them, the roofline elsewhere.

Ops the database knows (same op, shapes, dtypes, device and torch version) get their measured
forward and backward; every other op, every transfer and every collective is asked of the
roofline model of the same device; a pipeline's compute factor is the database's where it was
measured in that pipeline (``--profile-pipeline``). So a database profiled on this CPU changes
nothing when compiling for an H100, and a partly profiled model is still costed everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cost_models.counting import Kernel
from cost_models.database import CoRunMeasurement, CostDatabase, OpTimes, PipelineMeasurement, RuntimeOverheads
from cost_models.devices import DeviceSpec
from cost_models.roofline import RooflineCostModel

__all__ = ["ProfiledCostModel", "optimizer_key", "optimizer_call_key"]


def optimizer_key(optimizer: str, shape: tuple[int, ...], dtype: str) -> str:
    """Database key of what one parameter adds to an optimizer step (stored as its ``forward_s``)."""
    return f"optimizer.{optimizer}({dtype}[{','.join(map(str, shape))}])"


def optimizer_call_key(optimizer: str) -> str:
    """Database key of the fixed cost of one ``optimizer.step()``, whatever its parameters: a
    rank steps all its parameters in one call, so this is paid once per rank and step."""
    return f"optimizer.{optimizer}(call)"


@dataclass(frozen=True, kw_only=True)
class ProfiledCostModel:
    roofline: RooflineCostModel
    database: CostDatabase = field(repr=False)

    @property
    def name(self) -> str:
        return f"profiled:{self.device.name}"

    @property
    def device(self) -> DeviceSpec:
        return self.roofline.device

    def kernel_time(self, kernel: Kernel) -> float:
        return self.roofline.kernel_time(kernel)

    def kernels_time(self, kernels: Iterable[Kernel]) -> float:
        return self.roofline.kernels_time(kernels)

    def op_times(self, op_key: str, forward: Sequence[Kernel], backward_input: Sequence[Kernel],
                 backward_weight: Sequence[Kernel]) -> OpTimes:
        measured = self.database.get(self.device.name, op_key)
        if measured is not None:
            return measured
        return self.roofline.op_times(op_key, forward, backward_input, backward_weight)

    def optimizer_time(self, optimizer: str, parameters: Iterable[tuple[tuple[int, ...], str]]) -> float:
        """One ``step()`` over ``parameters``: its fixed cost once, then each parameter's share."""
        total = 0.0
        for shape, dtype in parameters:
            measured = self.database.get(self.device.name, optimizer_key(optimizer, shape, dtype))
            total += measured.forward_s if measured else self.roofline.optimizer_time(optimizer, [(shape, dtype)])
        call = self.database.get(self.device.name, optimizer_call_key(optimizer))
        return total + (call.forward_s if call is not None and total > 0 else 0.0)

    @property
    def runtime_overheads(self) -> RuntimeOverheads:
        return self.database.overheads.get(self.device.name, self.roofline.runtime_overheads)

    def p2p_time(self, nbytes: float, *, across_nodes: bool = False) -> float:
        return self.roofline.p2p_time(nbytes, across_nodes=across_nodes)

    def p2p_rank_time(self, nbytes: float, *, across_nodes: bool = False) -> tuple[float, float]:
        return self.roofline.p2p_rank_time(nbytes, across_nodes=across_nodes)

    def p2p_busy_delay(self) -> float:
        return self.roofline.p2p_busy_delay()

    def wake_time(self, idle_s: float) -> float:
        return self.roofline.wake_time(idle_s)

    def pipeline_compute_factor(self) -> float:
        return self.roofline.pipeline_compute_factor()

    def pipeline_profile(self, pipeline: str) -> PipelineMeasurement | None:
        return self.database.pipeline(self.device.name, pipeline)

    def co_run(self, key: str) -> CoRunMeasurement | None:
        return self.database.co_run(self.device.name, key)

    def collective_time(self, kind: str, nbytes: float, group_size: int, *, nodes: int = 1,
                        members: int | None = None) -> float:
        return self.roofline.collective_time(kind, nbytes, group_size, nodes=nodes, members=members)
