"""FLOPs of the kernels that run on matrix units: matmuls, convolutions, attention.

A multiply-add is 2 FLOPs: a matrix product (m×k)·(k×n) is 2·m·k·n. A bias added in the same
kernel (addmm, baddbmm) is not counted, since it runs in the GEMM epilogue at no extra time;
this matches ``torch.utils.flop_counter``, so the two can be checked against each other.

Attention is counted dense: a causal mask does not halve the count. That is the convention of
MFU accounting and of the 72·B·L·s·h² formula; a kernel that skips masked blocks is simply
faster than its count. The backward recomputes the score matrix, as flash kernels do, so it is
2.5× the forward rather than 2×.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import torch

from cost_models._ops import OpCall, Rule, arg, concrete_int, numel, shape

__all__ = ["MATMUL_RULES"]


def _matmul_flops(a: torch.Tensor, b: torch.Tensor) -> float:
    """2·batch·m·k·n for (…, m, k)·(…, k, n); a vector operand counts as one row or column."""
    a_shape, b_shape = shape(a), shape(b)
    k = a_shape[-1]
    m = a_shape[-2] if len(a_shape) >= 2 else 1
    n = b_shape[-1] if len(b_shape) >= 2 else 1
    batch = prod(a_shape[:-2]) if len(a_shape) > 2 else 1
    return 2.0 * batch * m * k * n


def _mm(first: str, second: str) -> Callable[[OpCall], float]:
    return lambda call: _matmul_flops(call.args[first], call.args[second])


def _mm_like(call: OpCall) -> float:
    """mm(self, mat2), mv(self, vec), dot(self, tensor): the second operand's name varies."""
    return _matmul_flops(call.args["self"], arg(call, "mat2", "vec", "tensor"))


def _outer_flops(call: OpCall) -> float:
    return 2.0 * numel(call.args["vec1"]) * numel(call.args["vec2"])


def _conv_forward_flops(input_shape: tuple[int, ...], weight_shape: tuple[int, ...],
                        output_shape: tuple[int, ...], transposed: bool) -> float:
    """2·N·prod(weight)·prod(spatial): every weight element meets every spatial position once.

    The weight is (C_out, C_in/groups, *k) for a convolution and (C_in, C_out/groups, *k) for a
    transposed one, so groups are accounted for; the spatial positions are the output's for a
    convolution and the input's for a transposed one.
    """
    spatial = (input_shape if transposed else output_shape)[2:]
    return 2.0 * input_shape[0] * prod(weight_shape) * prod(spatial)


def _conv_flops(call: OpCall) -> float:
    inp, weight = arg(call, "input", "self"), call.args["weight"]
    transposed = bool(call.args.get("transposed", False)) or "transpose" in call.name
    return _conv_forward_flops(shape(inp), shape(weight), shape(call.outputs[0]), transposed)


def _conv_backward_flops(call: OpCall) -> float:
    """Input gradient and weight gradient each cost one forward; the bias gradient is a sum."""
    grad_out = call.args["grad_output"]
    mask = call.args.get("output_mask") or (True, True, True)
    forward = _conv_forward_flops(shape(call.args["input"]), shape(call.args["weight"]),
                                  shape(grad_out), bool(call.args.get("transposed", False)))
    return forward * (int(mask[0]) + int(mask[1])) + (numel(grad_out) if mask[2] else 0)


# --- attention -------------------------------------------------------------------------------

def _attention_sizes(call: OpCall, *, heads_second: bool) -> tuple[float, int, int, int]:
    """(Σ over sequences of s_q·s_k, query heads, d_qk, d_v), from either memory layout.

    SDPA-level ops take (batch, heads, seq, dim); the raw flash/efficient kernels take
    (batch, seq, heads, dim), or (total_tokens, heads, dim) with cumulative sequence offsets.
    """
    q, k, v = call.args["query"], call.args["key"], call.args["value"]
    q_shape, k_shape, v_shape = shape(q), shape(k), shape(v)
    if heads_second:
        batch, heads, s_q, d_qk = q_shape
        return float(batch * s_q * k_shape[-2]), heads, d_qk, v_shape[-1]
    if len(q_shape) == 4:
        batch, s_q, heads, d_qk = q_shape
        return float(batch * s_q * k_shape[1]), heads, d_qk, v_shape[-1]
    _, heads, d_qk = q_shape
    offsets_q = arg(call, "cum_seq_q", "cu_seqlens_q")
    offsets_k = arg(call, "cum_seq_k", "cu_seqlens_k")
    return _varlen_score_elements(offsets_q, offsets_k, call), heads, d_qk, v_shape[-1]


def _varlen_score_elements(offsets_q: Any, offsets_k: Any, call: OpCall) -> float:
    """Σ s_q·s_k over packed sequences; with fake offsets, every sequence at its maximum length."""
    if isinstance(offsets_q, torch.Tensor) and isinstance(offsets_k, torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(offsets_q, FakeTensor) and offsets_q.device.type != "meta":
            lengths_q = offsets_q.diff().tolist()
            lengths_k = offsets_k.diff().tolist()
            return float(sum(a * b for a, b in zip(lengths_q, lengths_k)))
        sequences = numel(offsets_q) - 1
        max_q = concrete_int(arg(call, "max_q", "max_seqlen_q"))
        max_k = concrete_int(arg(call, "max_k", "max_seqlen_k"))
        return float(sequences * max_q * max_k)
    raise AssertionError(f"{call.name}: 3-D query without sequence offsets")


def _attention_forward(*, heads_second: bool) -> Callable[[OpCall], float]:
    def flops(call: OpCall) -> float:
        scores, heads, d_qk, d_v = _attention_sizes(call, heads_second=heads_second)
        return 2.0 * scores * heads * (d_qk + d_v)  # Q·Kᵀ, then P·V
    return flops


def _attention_backward(*, heads_second: bool) -> Callable[[OpCall], float]:
    def flops(call: OpCall) -> float:
        scores, heads, d_qk, d_v = _attention_sizes(call, heads_second=heads_second)
        # recompute Q·Kᵀ, dO·Vᵀ, Pᵀ·dO, dS·K, dSᵀ·Q
        return 2.0 * scores * heads * (3 * d_qk + 2 * d_v)
    return flops


def _build() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}

    def add(names: tuple[str, ...], rule: Rule) -> None:
        for name in names:
            rules[name] = rule

    add(("mm", "_int_mm", "_scaled_mm", "mv", "dot", "vdot"),
        Rule(category="matmul", flops=_mm_like))
    add(("addmm", "_addmm_activation"), Rule(category="matmul", flops=_mm("mat1", "mat2")))
    add(("addmv",), Rule(category="matmul", flops=_mm("mat", "vec")))
    add(("bmm",), Rule(category="matmul", flops=_mm("self", "mat2")))
    add(("baddbmm", "addbmm"), Rule(category="matmul", flops=_mm("batch1", "batch2")))
    add(("addr",), Rule(category="matmul", flops=_outer_flops))
    add(("convolution", "_convolution", "convolution_overrideable", "cudnn_convolution",
         "cudnn_convolution_transpose", "mkldnn_convolution", "miopen_convolution",
         "_slow_conv2d_forward", "slow_conv3d_forward", "slow_conv_dilated2d",
         "slow_conv_dilated3d", "slow_conv_transpose2d", "slow_conv_transpose3d",
         "_conv_depthwise2d", "conv_depthwise3d"),
        Rule(category="matmul", flops=_conv_flops))
    add(("convolution_backward", "convolution_backward_overrideable"),
        Rule(category="matmul", flops=_conv_backward_flops))

    add(("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math",
         "_scaled_dot_product_attention_math_for_mps"),
        Rule(category="attention", flops=_attention_forward(heads_second=True)))
    add(("_scaled_dot_product_flash_attention_backward",
         "_scaled_dot_product_efficient_attention_backward",
         "_scaled_dot_product_cudnn_attention_backward",
         "_scaled_dot_product_flash_attention_for_cpu_backward",
         "_scaled_dot_product_fused_attention_overrideable_backward"),
        Rule(category="attention", flops=_attention_backward(heads_second=True)))
    add(("_flash_attention_forward", "_efficient_attention_forward"),
        Rule(category="attention", flops=_attention_forward(heads_second=False)))
    add(("_flash_attention_backward", "_efficient_attention_backward"),
        Rule(category="attention", flops=_attention_backward(heads_second=False)))
    return rules


MATMUL_RULES = _build()
"""Rules by aten op name for matmuls, convolutions and every attention kernel."""
