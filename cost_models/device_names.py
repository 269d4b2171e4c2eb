"""The spec name of the device at hand: what its measurements are stored under.

Apart from `devices` so that the measurements (``comm_profile``) can name the device without
importing the spec loader, which reads those measurements in turn.
"""

from __future__ import annotations

__all__ = ["local_device_name", "spec_name"]


def spec_name(gpu_name: str, memory_bytes: int) -> str:
    """The spec name of a GPU that torch calls ``gpu_name``; a part without a spec of its own
    keeps that name (lower case, dashes), which `load_device` refuses with the known specs
    listed. Variants are told apart, never folded into the nearest spec: an H100 PCIe has half
    an SXM's memory bandwidth, and an NVL part another power limit, so the SXM's figures would
    promise plans they cannot keep."""
    name = gpu_name.upper()
    if "NVL" not in name:
        if "H200" in name:
            return "h200"
        if "H100" in name and "PCIE" in name:
            return "h100-pcie"
        if "H100" in name and ("SXM" in name or "HBM3" in name):  # the SXM5 part reports "H100 80GB HBM3"
            return "h100-sxm"
        if "MI300X" in name:
            return "mi300x"
        if "A100" in name:
            return "a100-80gb" if memory_bytes > 50e9 else "a100-40gb"
    return gpu_name.lower().replace(" ", "-")


def local_device_name(kind: str) -> str:
    """The spec name of the device at hand of ``kind`` (``"cpu"`` or ``"cuda"``), under which
    measurements of it are stored (`spec_name`)."""
    if kind != "cuda":
        return "cpu"
    import torch

    return spec_name(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
