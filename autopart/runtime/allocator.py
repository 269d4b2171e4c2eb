"""The CUDA caching allocator's setting for a training run, made before torch is imported.

The memory model counts tensors (and the CUDA context and the collective library's buffers
beside them). The caching allocator holds more than the tensors: it reserves memory in segments
and keeps the blocks that freed activations leave, which a later, larger request may not fit
(fragmentation), so a plan near the device's limit can run out with room to spare on paper.
Expandable segments let a segment grow in place instead of a new one being reserved beside it,
which keeps what is reserved close to what is allocated; torchtitan's launch script exports the
same setting. A setting of the user's own, under any of the names torch reads, is left as it is.

PyTorch reads the variable once, when the allocator starts; the generated ``train.py`` calls
`prefer_expandable_segments` before it imports anything that imports torch. The name is
``PYTORCH_CUDA_ALLOC_CONF``, which every torch from 2.4 reads first (ROCm builds too): the newer
``PYTORCH_ALLOC_CONF`` is ignored by older versions and, by reports, by the CUDA allocator of
some newer ones. On a CPU the allocator is the system's, and the variable is never read.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["EXPANDABLE", "prefer_expandable_segments"]

EXPANDABLE = "expandable_segments:True"
_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None) -> None:
    """Turn on expandable segments in ``environ`` (this process's) unless the user set the allocator."""
    environ = os.environ if environ is None else environ
    if not any(name in environ for name in _NAMES):
        environ[_NAMES[0]] = EXPANDABLE
