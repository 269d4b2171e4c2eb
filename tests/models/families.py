"""The Transformer families whose tensor-parallel layout the tests check, at any size.

``family(name, **sizes)`` gives a model-file namespace (``build_model``, ``example_batch``,
``loss_fn``, ``init_weights``) for one family; ``meta=True`` builds it on the meta device, so
that widths where compute, not kernel launches, decides the layout compile in seconds:

- ``gpt``: examples/gpt.py (fused QKV split with ``.split``, tied head);
- ``llama``: examples/llama.py (GQA through ``repeat_interleave``, RMSNorm, SwiGLU, rotary);
- ``plain_gpt``: a GPT of plain ``torch.nn`` pieces as users write it (``nn.Linear(h, 3h)``,
  ``.split``, ``view`` + ``transpose``, SDPA ``is_causal``, ``reshape`` back, tied head);
- ``untraceable_gpt``: nanoGPT's shape with an ``assert`` on the sequence length, which fx cannot
  trace: captured with torch.export (aten ``linear``, ``view``, ``split``);
- ``hf_gpt2`` and ``hf_llama``: Hugging Face transformers models (Conv1D's ``addmm`` with a
  transposed weight; GQA through ``expand``), captured with torch.export;
- ``hf_mixtral``: transformers' Mixtral (top-2 of 4 experts, through the custom op
  ``torch.ops.transformers.grouped_mm_fallback``), captured with torch.export.

Each model file in a test is two lines: import this module and bind the names of one family.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402
import llama  # noqa: E402


class _PlainBlock(nn.Module):
    def __init__(self, width: int, heads: int, untraceable: bool):
        super().__init__()
        self.heads, self.untraceable = heads, untraceable
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        B, T, C = x.shape
        if self.untraceable:
            assert T % 8 == 0, "the sequence must be a multiple of 8"  # fx cannot trace this
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _PlainGPT(nn.Module):
    def __init__(self, *, vocab: int, seq: int, width: int, heads: int, layers: int, untraceable: bool):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(_PlainBlock(width, heads, untraceable) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


class _Logits(nn.Module):
    """A Hugging Face causal LM as a user wraps it: token ids in, logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(input_ids=tokens).logits  # (B, T, vocab)


def _hf(name: str, *, vocab: int, seq: int, width: int, heads: int, kv_heads: int, layers: int) -> nn.Module:
    import transformers

    if name == "hf_gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return _Logits(transformers.GPT2LMHeadModel(config))
    if name == "hf_mixtral":  # made as AutoModelForCausalLM makes it: transformers' MoE module imported only now
        config = transformers.MixtralConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                                            num_hidden_layers=layers, num_attention_heads=heads,
                                            num_key_value_heads=kv_heads, max_position_embeddings=seq,
                                            num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
        return _Logits(transformers.AutoModelForCausalLM.from_config(config))
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=seq)  # fmt: skip
    return _Logits(transformers.LlamaForCausalLM(config))


def family(name: str, *, vocab: int = 256, seq: int = 16, width: int = 64, heads: int = 8, kv_heads: int = 4,
           layers: int = 2, meta: bool = False) -> SimpleNamespace:
    """The model-file functions of family ``name`` at these sizes."""

    def build_model() -> nn.Module:
        torch.manual_seed(0)
        with torch.device("meta") if meta else torch.device("cpu"):
            if name == "gpt":
                return gpt.GPT(gpt.GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width))
            if name == "llama":
                return llama.Llama(llama.LlamaConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads,
                                                     n_kv_head=kv_heads, dim=width, ffn_dim=4 * width))  # fmt: skip
            if name in ("plain_gpt", "untraceable_gpt"):
                return _PlainGPT(vocab=vocab, seq=seq, width=width, heads=heads, layers=layers,
                                 untraceable=name == "untraceable_gpt")  # fmt: skip
            return _hf(name, vocab=vocab, seq=seq, width=width, heads=heads, kv_heads=kv_heads, layers=layers)

    def example_batch(batch_size: int):
        generator = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
        return (tokens[:, :-1],), tokens[:, 1:]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def init_weights(module: nn.Module) -> None:
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if tensor.dim() > 1:
                nn.init.normal_(tensor, std=0.02)
            else:
                nn.init.ones_(tensor)

    return SimpleNamespace(build_model=build_model, example_batch=example_batch, loss_fn=loss_fn,
                           init_weights=init_weights if meta else None)  # fmt: skip
