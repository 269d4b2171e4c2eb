"""The recompute modes a plan names, and the one definition of what selective recompute keeps.

The runtime's checkpoint policy and the annotate pass both ask `keeps_output`, so it lives
here, below both.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECOMPUTE_MODES", "KEPT_OPS", "keeps_output"]


RECOMPUTE_MODES = ("none", "selective", "full")


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
