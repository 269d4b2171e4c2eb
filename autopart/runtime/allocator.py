"""The CUDA caching allocator's setting for a training run, made before torch is imported.

The memory model counts tensors, what ``torch.cuda.max_memory_allocated`` shows. The caching
allocator holds more than that: it reserves memory in segments and keeps the blocks that freed
activations leave, which a later, larger request may not fit (fragmentation), so a plan near
the device's limit can run out with room to spare on paper. Expandable segments let a segment
grow in place instead of a new one being reserved beside it, which keeps what is reserved close
to what is allocated; torchtitan's launch script exports the same setting. A setting of the
user's own, under either name, is left as it is.

PyTorch reads the variable once, when the allocator starts; the generated ``train.py`` calls
`prefer_expandable_segments` before it imports anything that imports torch. Torch 2.9 renamed it
``PYTORCH_ALLOC_CONF`` (``PYTORCH_CUDA_ALLOC_CONF`` before); older versions ignore the new name.
On a CPU the allocator is the system's, and the variable is never read.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from importlib import metadata

__all__ = ["EXPANDABLE", "prefer_expandable_segments"]

EXPANDABLE = "expandable_segments:True"
_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None,
                               torch_version: str | None = None) -> None:
    """Turn on expandable segments in ``environ`` (this process's) unless the user set the
    allocator already; under the name that ``torch_version`` (the installed torch's) reads."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _NAMES):
        return
    version = torch_version if torch_version is not None else _installed_torch()
    environ[_NAMES[0] if _at_least(version, (2, 9)) else _NAMES[1]] = EXPANDABLE


def _installed_torch() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a build without its metadata: the current name
        return "2.9"


def _at_least(version: str, least: tuple[int, int]) -> bool:
    parts = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())  # "0a0" of a nightly
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= least
