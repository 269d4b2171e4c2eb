"""Hardware knowledge for autopart: what kernels cost and how fast devices and links are.

The compiler asks one question of this package, through `get_cost_model`: given a device,
how long do these kernels and these transfers take. Everything that knows a device by name
(spec files, calibration, efficiencies) stays in here.
"""

from __future__ import annotations

from cost_models.base import CostModel
from cost_models.counting import Kernel, KernelRecorder
from cost_models.devices import DeviceSpec, known_devices, load_device
from cost_models.memory import model_state_bytes
from cost_models.roofline import RooflineCostModel

__all__ = [
    "CostModel",
    "DeviceSpec",
    "Kernel",
    "KernelRecorder",
    "RooflineCostModel",
    "get_cost_model",
    "known_devices",
    "load_device",
    "model_state_bytes",
]


def get_cost_model(device: str = "cpu") -> CostModel:
    """The roofline cost model of a bundled device by name, or of a ``.toml`` spec by path.

    ``"cpu"`` is this machine, measured on first use and cached.
    """
    return RooflineCostModel(device=load_device(device))
