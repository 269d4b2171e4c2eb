"""Llama from Hugging Face transformers (5.x), a tiny random-initialised config, wrapped as a user
would: a module that takes token ids and returns the logits.

    autopart compile tests/models/hf_llama.py -o out/hf_llama --pp 2 --microbatches 4
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 128, 16
CONFIG = LlamaConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
)  # fmt: skip


class LlamaLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.llama = LlamaForCausalLM(CONFIG)

    def forward(self, tokens):
        return self.llama(input_ids=tokens).logits  # (B, T, vocab)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LlamaLogits()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
