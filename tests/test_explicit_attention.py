"""The benchmark models' attention as Megatron ran it before FlashAttention
(``benchmarks/models/shallow.py``, ``ExplicitAttention``): the same function as SDPA, and what the
cost model sees of it on a GPU: the T x T scores, their softmax and dropout, held in 16 bits."""

from __future__ import annotations

import sys

import pytest
import torch

from autopart.options import CompileOptions
from autopart.passes.front import build_front
from tests.distributed import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "models"))
import shallow  # noqa: E402

H, HEADS, T = 128, 4, 64

MODEL = """
import sys
sys.path.insert(0, {models!r})
from shallow import gpt3
MODEL = gpt3(n_embd={h}, n_head={heads}, layers=2, seq_len={t}, vocab_size=256, attention={attention!r}, dropout={dropout})
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
"""


def test_explicit_attention_computes_what_sdpa_computes():
    def attention(kind: str) -> torch.nn.Module:
        model = shallow.gpt3(n_embd=H, n_head=HEADS, layers=1, seq_len=T, vocab_size=256, attention=kind)
        return model.build_model().h[0].attn.to_empty(device="cpu")

    fused, explicit = attention("fused"), attention("explicit")
    torch.manual_seed(0)
    for p in explicit.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fused.load_state_dict(explicit.state_dict())
    x = torch.randn(2, T, H)
    torch.testing.assert_close(explicit(x), fused(x), rtol=1e-5, atol=1e-5)


def test_dropout_is_explicit_attention_s_only():
    with pytest.raises(ValueError, match="dropout is modelled with explicit attention only"):
        shallow.gpt3(n_embd=H, n_head=HEADS, dropout=0.1)


def _front(tmp_path, attention: str, dropout: float):
    path = tmp_path / f"{attention}_{dropout:g}.py"
    path.write_text(MODEL.format(models=str(REPO / "benchmarks" / "models"), h=H, heads=HEADS, t=T,
                                 attention=attention, dropout=dropout))  # fmt: skip
    options = CompileOptions(model=path, device="a100-80gb", dtype="bf16", micro_batch_size=1, microbatches=1,
                             measure=False)  # fmt: skip
    return build_front(options, 1)


def test_the_scores_are_saved_in_16_bits_with_a_one_byte_dropout_mask(tmp_path):
    """Per score element, backward keeps the probabilities (2 bytes, for the softmax), and with
    dropout the mask (1 byte) and the dropped probabilities (2 bytes, for the product with the
    values): Korthikanti et al.'s 5·a·s/h per token and hidden unit. The hidden dropouts add a
    one-byte mask of each (T, H) output, two per layer."""
    saved = {}
    for dropout in (0.0, 0.1):
        front = _front(tmp_path, "explicit", dropout)
        softmax = [n for n in front.op_graph.nodes.values() if n.name.startswith("softmax")]
        assert len(softmax) == 2 and all(n.output.dtype == "bfloat16" for n in softmax)  # Megatron's kernel: 16 bits
        saved[dropout] = sum(b.saved_bytes for b in front.chain.blocks)
    layers, scores = 2, HEADS * T * T
    assert saved[0.1] - saved[0.0] == layers * (3 * scores + 2 * T * H)


def test_explicit_attention_costs_more_than_fused(tmp_path):
    fused, explicit = (_front(tmp_path, attention, 0.0) for attention in ("fused", "explicit"))
    assert sum(b.forward_s for b in explicit.chain.blocks) > sum(b.forward_s for b in fused.chain.blocks)
    assert sum(b.saved_bytes for b in explicit.chain.blocks) > sum(b.saved_bytes for b in fused.chain.blocks)
