"""The recompute modes a plan names, and the one definition of what selective recompute keeps.

The runtime's checkpoint policy and the annotate pass both ask `keeps_output`, so it lives
here, below both.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECOMPUTE_MODES", "KEPT_OPS", "dropout_mask_bytes", "keeps_output"]


RECOMPUTE_MODES = ("none", "selective", "full", "stage")
"""From the least memory saved and time spent to the most, as the search tries them: ``full``
checkpoints layer by layer, ``stage`` the stage whole (`autopart.passes.recompute`), which holds
less where many microbatches are in flight on a stage of few layers, and runs no faster."""


KEPT_OPS = frozenset({
    # matrix products, as aten sees them below F.linear and torch.matmul
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "linear", "_scaled_mm", "_int_mm",
    # fused attention kernels (the math fallback decomposes into bmm, kept above, and softmax)
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
})
"""aten ops (overload packets) whose outputs selective recompute keeps."""


def keeps_output(op: Any) -> bool:
    """Whether selective recompute keeps the output of ``op``: an aten overload
    (``torch.ops.aten.mm.default``) or its name (``"aten.mm.default"``, as `Kernel.op` has it)."""
    namespace, _, rest = str(op).partition(".")
    return namespace == "aten" and rest.partition(".")[0] in KEPT_OPS


def dropout_mask_bytes(target: Any, saved: Any, device_kind: str) -> int | None:
    """Bytes that a dropout's saved mask takes on ``device_kind``, where that differs from the
    tensor the measuring run saved (None otherwise). The CPU kernels (and fake tensors, which run
    them) keep the mask in the input's dtype; CUDA's and ROCm's fused kernel keeps a bool mask,
    one byte an element, which is what Korthikanti et al. count (the 5as/h term's third)."""
    if device_kind not in ("cuda", "rocm") or "dropout" not in getattr(target, "__name__", str(target)):
        return None
    return saved.numel() if saved.is_floating_point() else None
