"""Per-op FLOP and byte formulas for the aten ops that matter to a training step.

`counting.KernelRecorder` sees every aten call; this module decides what each one costs
(matmuls, convolutions and attention are in `cost_models._matmul_formulas`).

- Elementwise work is counted per output element: 1 for arithmetic, more for transcendental
  functions (table `ELEMENTWISE_FLOPS`). These counts matter little: such kernels are bound by
  memory, and the roofline charges them for bytes.
- Bytes are what a kernel reads plus what it writes, each tensor once, a broadcast (stride 0)
  dimension read once. Gathers (embedding, index_select) read only the rows they fetch; the
  negative log-likelihood reads one logit per target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cost_models._matmul_formulas import MATMUL_RULES
from cost_models._ops import (
    OpCall,
    Rule,
    first_input_numel,
    first_output_numel,
    numel,
    per_input_element,
    per_output_element,
    tensor_bytes,
    written_bytes,
    zero,
)

__all__ = [
    "ELEMENTWISE_FLOPS",
    "METADATA_OPS",
    "REDUCTION_FLOPS",
    "RULES",
    "SOFTMAX_FLOPS",
    "VIEW_OPS",
    "fallback_rule",
    "rule_for",
]


ELEMENTWISE_FLOPS: Mapping[str, float] = {
    # transcendental functions: a few FMAs of a polynomial after range reduction
    **{name: 4.0 for name in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sigmoid", "tanh", "sin", "cos",
        "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf",
        "erfc", "erfinv", "logit", "lgamma", "digamma", "softplus", "logaddexp")},
    "sqrt": 2.0, "rsqrt": 2.0,
    "gelu": 8.0,  # x·½·(1 + erf(x/√2)): erf 4, four multiplies and adds
    "gelu_backward": 15.0,  # erf and exp of the same argument, ~7 multiplies and adds
    "silu": 5.0, "silu_backward": 8.0,  # x·σ(x), and σ·(1 + x·(1 − σ))·g
    "mish": 9.0, "mish_backward": 14.0,
    "elu": 5.0, "selu": 5.0, "celu": 5.0, "elu_backward": 5.0,
    "sigmoid_backward": 3.0, "tanh_backward": 3.0, "softplus_backward": 6.0,
    "native_dropout": 3.0, "native_dropout_backward": 2.0,  # draw, compare, scale
}
"""FLOPs per output element for elementwise ops; any other pointwise op counts 1."""


def _pow_flops(call: OpCall) -> float:
    """x² and x³ are multiplies, x^0.5 a square root; other exponents go through exp and log."""
    exponent = call.args.get("exponent")
    cheap: dict[Any, float] = {1: 1.0, 2: 1.0, 3: 2.0, 0.5: 2.0}
    per_element = 8.0 if isinstance(exponent, torch.Tensor) else cheap.get(exponent, 8.0)
    return per_element * first_output_numel(call)


REDUCTION_FLOPS: Mapping[str, float] = {
    "var": 3.0, "std": 3.0, "var_mean": 3.0, "std_mean": 3.0,  # subtract, square, add
    "norm": 2.0, "linalg_vector_norm": 2.0,  # square, add
    "logsumexp": 6.0,  # max, subtract, exp, add
}
"""FLOPs per input element for reductions; any other reduction counts 1."""


SOFTMAX_FLOPS: Mapping[str, float] = {
    "_softmax": 8.0, "_safe_softmax": 8.0,  # max, subtract, exp (4), sum, divide
    "_log_softmax": 8.0,  # max, subtract, exp (4), sum, subtract (the row log is negligible)
    "_softmax_backward_data": 4.0,  # y·(g − Σ g·y): multiply, sum, subtract, multiply
    "_log_softmax_backward_data": 7.0,  # g − exp(y)·Σ g: sum, exp (4), multiply, subtract
}
"""FLOPs per element of the softmax input."""


def _affine(call: OpCall) -> int:
    return int(call.args.get("weight") is not None) + int(call.args.get("bias") is not None)


def _norm_forward(call: OpCall) -> float:
    """Mean (1), variance (3), normalise (2), then scale and shift if the norm has them."""
    return (6.0 + _affine(call)) * first_input_numel(call)


def _norm_backward(call: OpCall) -> float:
    """Input gradient ≈ 10 per element; weight gradient 2 (multiply, sum); bias gradient 1."""
    mask = call.args.get("output_mask") or (True, True, True)
    per_element = 10.0 * bool(mask[0]) + 2.0 * bool(mask[1]) + 1.0 * bool(mask[2])
    return per_element * numel(call.args["input"])


def _rms_norm_forward(call: OpCall) -> float:
    """Square and sum (2), scale (1), weight (1)."""
    return (3.0 + (call.args.get("weight") is not None)) * first_input_numel(call)


def _rms_norm_backward(call: OpCall) -> float:
    mask = call.args.get("output_mask") or (True, True)
    return (7.0 * bool(mask[0]) + 2.0 * bool(mask[1])) * numel(call.args["input"])


# --- gathers, losses, copies -----------------------------------------------------------------

def _gather_bytes(call: OpCall) -> float:
    """Indices read, then each fetched row read once and written once; the table is not read."""
    indices = [t for t in call.inputs if not t.is_floating_point() and not t.is_complex()]
    return float(sum(tensor_bytes(t) for t in indices) + 2 * written_bytes(call))


def _nll_forward_bytes(call: OpCall) -> float:
    """Targets, one logit per target, and the outputs: the logits are gathered, not streamed."""
    target, logits = call.args["target"], call.args["self"]
    return float(tensor_bytes(target) + numel(target) * logits.element_size() + written_bytes(call))


def _nll_backward_bytes(call: OpCall) -> float:
    """The gradient is written whole (zeros and one value per row); the logits are not read."""
    return float(tensor_bytes(call.args["target"]) + tensor_bytes(call.args["grad_output"])
                 + written_bytes(call))


def _per_target(call: OpCall) -> float:
    return float(numel(call.args["target"]))


def _copy_into_bytes(call: OpCall) -> float:
    return float(tensor_bytes(call.args["src"]) + written_bytes(call))


_GATHERS = ("index_select", "gather", "index", "_unsafe_index", "take")
_COPIES = (
    "_to_copy", "clone", "_copy_from", "_copy_from_and_resize", "cat", "stack", "constant_pad_nd",
    "repeat", "repeat_interleave", "flip", "roll", "tril", "triu", "scatter", "scatter_add",
    "scatter_reduce", "index_put", "index_put_", "_index_put_impl_", "index_add", "index_copy",
    "index_fill", "masked_scatter", "slice_scatter", "select_scatter", "diagonal_scatter",
    "as_strided_scatter", "narrow_copy", "lift_fresh_copy", "_local_scalar_dense", "where_copy",
    "_pin_memory", "pad", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
    "replication_pad2d", "split_with_sizes_copy", "unbind_copy",
)
_FILLS = (
    "fill", "fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
    "new_zeros", "new_ones", "new_full", "scalar_tensor", "arange", "linspace", "eye",
)
VIEW_OPS = frozenset({
    "_unsafe_view", "_reshape_alias", "alias", "detach", "detach_", "lift_fresh", "_conj",
    "_neg_view", "resolve_conj", "resolve_neg", "view_as_real", "view_as_complex",
    # allocations: memory is reserved, not touched
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "set_",
})
"""Ops that touch no data although their schema does not say they alias."""

METADATA_OPS = frozenset({
    "size", "sym_size", "stride", "sym_stride", "storage_offset", "sym_storage_offset", "numel",
    "sym_numel", "dim", "is_contiguous", "sym_is_contiguous", "is_strides_like_format",
    "is_non_overlapping_and_dense", "device", "layout",
})
"""Queries answered from metadata: not kernels, not recorded."""


def _build_rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = dict(MATMUL_RULES)

    def add(names: tuple[str, ...] | list[str], rule: Rule) -> None:
        for name in names:
            rules[name] = rule

    for name, per_element in ELEMENTWISE_FLOPS.items():
        add((name, name + "_"), Rule(category="elementwise", flops=per_output_element(per_element)))
    add(("pow", "pow_"), Rule(category="elementwise", flops=_pow_flops))
    for name, per_element in REDUCTION_FLOPS.items():
        add((name,), Rule(category="reduction", flops=per_input_element(per_element)))
    for name, per_element in SOFTMAX_FLOPS.items():
        add((name,), Rule(category="softmax", flops=per_input_element(per_element)))

    add(("native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
         "_native_batch_norm_legit_no_training", "native_group_norm"),
        Rule(category="norm", flops=_norm_forward))
    add(("native_layer_norm_backward", "native_batch_norm_backward", "native_group_norm_backward"),
        Rule(category="norm", flops=_norm_backward))
    add(("_fused_rms_norm",), Rule(category="norm", flops=_rms_norm_forward))
    add(("_fused_rms_norm_backward",), Rule(category="norm", flops=_rms_norm_backward))

    add(("embedding",), Rule(category="embedding", flops=zero, bytes=_gather_bytes))
    add(("embedding_dense_backward",), Rule(category="embedding", flops=lambda call: float(
        numel(call.args["grad_output"]))))

    add(("nll_loss_forward", "nll_loss2d_forward"),
        Rule(category="loss", flops=_per_target, bytes=_nll_forward_bytes))
    add(("nll_loss_backward", "nll_loss2d_backward"),
        Rule(category="loss", flops=_per_target, bytes=_nll_backward_bytes))
    add(("mse_loss", "mse_loss_backward", "smooth_l1_loss", "smooth_l1_loss_backward",
         "huber_loss", "huber_loss_backward", "l1_loss", "soft_margin_loss"),
        Rule(category="loss", flops=per_input_element(3.0)))
    add(("binary_cross_entropy", "binary_cross_entropy_with_logits"),
        Rule(category="loss", flops=per_input_element(10.0)))
    add(("binary_cross_entropy_backward",), Rule(category="loss", flops=per_input_element(6.0)))

    add(_GATHERS, Rule(category="copy", flops=zero, bytes=_gather_bytes))
    add(_COPIES, Rule(category="copy", flops=zero))
    add(("copy_", "copy"), Rule(category="copy", flops=zero, bytes=_copy_into_bytes))
    add(_FILLS, Rule(category="copy", flops=zero, bytes=written_bytes))
    return rules


RULES: Mapping[str, Rule] = _build_rules()

_ELEMENTWISE = Rule(category="elementwise", flops=per_output_element(1.0))
_REDUCTION = Rule(category="reduction", flops=per_input_element(1.0))
_VIEW_COPY = Rule(category="copy", flops=zero)


def rule_for(name: str, tags: Any) -> Rule | None:
    """The op's own rule, else one inferred from its tags (pointwise, reduction, view_copy).

    None means nothing is known about the op: the caller decomposes it or falls back.
    """
    rule = RULES.get(name)
    if rule is not None:
        return rule
    if torch.Tag.pointwise in tags:
        return _ELEMENTWISE
    if torch.Tag.reduction in tags:
        return _REDUCTION
    if torch.Tag.view_copy in tags:
        return _VIEW_COPY
    return None


def fallback_rule() -> Rule:
    """For an op nothing is known about: one FLOP per output element, every tensor moved once."""
    return _ELEMENTWISE
