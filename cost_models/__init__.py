"""Hardware knowledge for autopart: what kernels cost and how fast devices and links are.

The compiler asks one question of this package, through `get_cost_model`: given a device,
how long do these kernels and these transfers take. Everything that knows a device by name
(spec files, calibration, efficiencies) stays in here.
"""

from __future__ import annotations

from cost_models.base import CostModel
from cost_models.counting import Kernel, KernelRecorder
from cost_models.database import CostDatabase, OpTimes, RuntimeOverheads
from cost_models.devices import DeviceSpec, known_devices, load_device
from cost_models.memory import model_state_bytes
from cost_models.profiled import ProfiledCostModel
from cost_models.roofline import RooflineCostModel

__all__ = [
    "CostDatabase",
    "CostModel",
    "DeviceSpec",
    "Kernel",
    "KernelRecorder",
    "OpTimes",
    "ProfiledCostModel",
    "RooflineCostModel",
    "RuntimeOverheads",
    "get_cost_model",
    "known_devices",
    "load_device",
    "model_state_bytes",
]


def get_cost_model(device: str = "cpu", costs: CostDatabase | None = None) -> CostModel:
    """The cost model of a bundled device by name, or of a ``.toml`` spec by path.

    ``"cpu"`` is this machine, measured on first use and cached. With ``costs``, measured op
    times answer where the database has them and the roofline everywhere else.
    """
    roofline = RooflineCostModel(device=load_device(device))
    return roofline if costs is None else ProfiledCostModel(roofline=roofline, database=costs)
