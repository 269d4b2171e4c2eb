"""The roofline cost model: a kernel takes as long as its arithmetic or its memory traffic.

    time = max(flops / (peak[dtype] · efficiency(flops)), bytes / (bandwidth · bw_efficiency))
           + kernel_overhead_s

Matmuls and attention are charged at the matrix-unit peak of their dtype, scaled by the
device's measured or estimated efficiency for a matmul of that size (attention's FLOPs are
counted dense, as MFU counts them; a causal kernel skips the masked half, so FlashAttention-2's
~35% of a Hopper's peak on its own work is ~70% against this count, near the curve); every
other kernel at the fp32 vector peak, which matters little since those kernels are bound by
memory. Views cost nothing: they launch no kernel.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cost_models import comm
from cost_models.counting import Kernel
from cost_models.database import CoRunMeasurement, OpTimes, PipelineMeasurement, RuntimeOverheads
from cost_models.devices import DeviceSpec

__all__ = ["RooflineCostModel"]

_MATRIX_CATEGORIES = frozenset({"matmul", "attention"})
_HALF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}
_OPTIMIZER_KERNELS = {"sgd": 1, "adamw": 10, "adam": 10}
_MULTI_TENSOR = {"sgd": (2, 3), "adamw": (4, 7), "adam": (4, 7)}  # tensor lists, tensors streamed per element
_MULTI_TENSOR_LISTS = {2: 64, 4: 36}  # the most tensors of each list one launch takes, by the lists' number
_MULTI_TENSOR_BLOCKS = 320
_MULTI_TENSOR_CHUNK = 65536


@dataclass(frozen=True, kw_only=True)
class RooflineCostModel:
    """A `CostModel` from a device's datasheet (or calibration) figures alone."""

    device: DeviceSpec

    @property
    def name(self) -> str:
        return f"roofline:{self.device.name}"

    def peak_flops(self, kernel: Kernel) -> float:
        """The peak that bounds this kernel.

        fp32 matmuls use the fp32 peak unless the device says they run as TF32; float8 and
        integer matmuls, having no figure in the spec, are charged at the 16-bit and fp32 peaks.
        """
        peaks = self.device.peak_flops
        if kernel.category not in _MATRIX_CATEGORIES:
            return peaks["float32"]
        if kernel.dtype in _HALF_DTYPES:
            return peaks[_HALF_DTYPES[kernel.dtype]]
        if kernel.dtype.startswith("float8"):
            return peaks["bfloat16"]
        if kernel.dtype == "float32" and self.device.fp32_matmul_uses_tf32:
            return peaks["tf32"]
        return peaks["float32"]

    def compute_time(self, kernel: Kernel) -> float:
        if kernel.flops <= 0:
            return 0.0
        efficiency = (self.device.matmul_efficiency_at(kernel.flops)
                      if kernel.category in _MATRIX_CATEGORIES else 1.0)
        return kernel.flops / (self.peak_flops(kernel) * efficiency)

    def memory_time(self, kernel: Kernel) -> float:
        return kernel.bytes / (self.device.memory_bandwidth * self.device.memory_efficiency)

    def kernel_time(self, kernel: Kernel) -> float:
        if kernel.category == "view":
            return 0.0
        return (max(self.compute_time(kernel), self.memory_time(kernel))
                + self.device.kernel_overhead_s)

    def kernels_time(self, kernels: Iterable[Kernel]) -> float:
        return sum((self.kernel_time(kernel) for kernel in kernels), 0.0)

    def op_times(self, op_key: str, forward: Sequence[Kernel], backward_input: Sequence[Kernel],
                 backward_weight: Sequence[Kernel]) -> OpTimes:
        return OpTimes(forward_s=self.kernels_time(forward), backward_input_s=self.kernels_time(backward_input),
                       backward_weight_s=self.kernels_time(backward_weight))

    def optimizer_time(self, optimizer: str, parameters: Iterable[tuple[tuple[int, ...], str]]) -> float:
        """The step as the runtime's optimizer runs it on this kind of device
        (`autopart.runtime.optim`): on the CPU, per tensor, the elementwise kernels of
        ``torch.optim``'s single-tensor step; on an accelerator, fused AdamW and foreach SGD
        (`_multi_tensor_time`).

        AdamW's single-tensor step runs about ten kernels per tensor (decay, two moment updates,
        bias corrections, the square root, the division, the update), each streaming about three
        tensors of the parameter's size; SGD one kernel over three.
        """
        if self.device.kind != "cpu":
            return self._multi_tensor_time(optimizer, list(parameters))
        kernels = _OPTIMIZER_KERNELS.get(optimizer, 1)
        total = 0.0
        for shape, dtype in parameters:
            numel = 1
            for size in shape:
                numel *= size
            nbytes = 3 * numel * (2 if dtype in _HALF_DTYPES else 4)
            total += kernels * (self.device.kernel_overhead_s + nbytes / (self.device.memory_bandwidth * self.device.memory_efficiency))
        return total

    def _multi_tensor_time(self, optimizer: str, parameters: list[tuple[tuple[int, ...], str]]) -> float:
        """Fused AdamW (one pass reading the weight, its gradient and both moments and writing the
        weight and the moments: 7 tensors streamed) or foreach SGD (3), as torch's
        multi_tensor_apply launches them: a launch takes at most ``_MULTI_TENSOR_LISTS`` tensors
        of each list and ``_MULTI_TENSOR_BLOCKS`` chunks of ``_MULTI_TENSOR_CHUNK`` elements
        (ATen/native/cuda/MultiTensorApply.cuh, the 4 KB kernel-argument limits)."""
        lists, streamed = _MULTI_TENSOR.get(optimizer, (2, 3))
        numels = [math.prod(shape) for shape, _ in parameters]
        if not numels:
            return 0.0
        chunks = sum(-(-n // _MULTI_TENSOR_CHUNK) for n in numels)
        launches = max(-(-len(numels) // _MULTI_TENSOR_LISTS[lists]), -(-chunks // _MULTI_TENSOR_BLOCKS))
        nbytes = sum(streamed * n * (2 if dtype in _HALF_DTYPES else 4) for n, (_, dtype) in zip(numels, parameters))
        return launches * self.device.kernel_overhead_s + nbytes / (self.device.memory_bandwidth * self.device.memory_efficiency)

    @property
    def runtime_overheads(self) -> RuntimeOverheads:
        """Not known without measuring: an op's modelled backward carries no call to subtract."""
        return RuntimeOverheads()

    def _link(self, across_nodes: bool) -> tuple[float, float]:
        """(bus bandwidth, latency) of the link a transfer crosses."""
        device = self.device
        if across_nodes:
            return device.inter_node_bandwidth * device.link_efficiency, device.inter_node_latency_s
        return device.intra_node_bandwidth * device.link_efficiency, device.intra_node_latency_s

    def p2p_time(self, nbytes: float, *, across_nodes: bool = False) -> float:
        measured = None if across_nodes or nbytes == 0 else self.device.measured_comm_time("p2p", nbytes)
        if measured is not None:
            return measured
        bandwidth, latency = self._link(across_nodes)
        return comm.p2p_time(nbytes, bandwidth=bandwidth, latency_s=latency)

    def p2p_rank_time(self, nbytes: float, *, across_nodes: bool = False) -> tuple[float, float]:
        """Measured by ``autopart profile-comm`` where it ran (never across nodes), else none:
        a device's copy engines and NICs move the bytes, not its compute units."""
        if across_nodes or nbytes == 0:
            return 0.0, 0.0
        send = self.device.measured_comm_time("p2p_send_cpu", nbytes)
        receive = self.device.measured_comm_time("p2p_recv_cpu", nbytes)
        return send or 0.0, receive or 0.0

    def p2p_busy_delay(self) -> float:
        """Measured by ``autopart profile-comm`` on a CPU whose cores it keeps busy, else none."""
        return self.device.measured_comm_time("p2p_busy_delay", 1) or 0.0

    def wake_time(self, idle_s: float) -> float:
        """Measured by ``autopart profile-comm`` on a CPU (the ``wake`` curve), else none: linear
        from nothing at no idleness through the measured points, flat past the last."""
        points = self.device.comm_curves.get("wake")
        if not points or idle_s <= 0:
            return 0.0
        previous = (0.0, 0.0)
        for idle, extra in points:
            if idle_s <= idle:
                return previous[1] + (extra - previous[1]) * (idle_s - previous[0]) / (idle - previous[0])
            previous = (idle, extra)
        return previous[1]

    def pipeline_compute_factor(self) -> float:
        """Measured by ``autopart profile-comm`` on a CPU, else 1: a device's own compute units
        are not shared with the other ranks'."""
        return max(1.0, self.device.measured_comm_time("pipeline_compute", 1) or 1.0)

    def pipeline_profile(self, pipeline: str) -> PipelineMeasurement | None:
        return None  # a spec holds no model's measurements: the cost database does

    def co_run(self, key: str) -> CoRunMeasurement | None:
        return None  # measured per model: the cost database holds it

    def collective_time(self, kind: str, nbytes: float, group_size: int, *, nodes: int = 1,
                        members: int | None = None) -> float:
        if nodes == 1 and group_size == self.device.comm_ranks and group_size > 1:
            measured = self.device.measured_comm_time(kind, nbytes)
            if measured is not None:
                return measured
        device = self.device
        bandwidth = device.intra_node_bandwidth
        if nodes > 1:
            bandwidth = min(bandwidth, comm.node_members(kind, group_size, nodes, members) * device.inter_node_bandwidth)
        return comm.collective_time(kind, nbytes, group_size, bus_bandwidth=bandwidth * device.link_efficiency,
                                    nodes=nodes, step_latency_s=device.intra_node_latency_s,
                                    node_step_latency_s=device.inter_node_latency_s, trees=device.kind != "cpu")
