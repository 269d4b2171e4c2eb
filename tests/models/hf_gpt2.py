"""GPT-2 from Hugging Face transformers (5.x), a tiny random-initialised config, wrapped as a user
would: a module that takes token ids and returns the logits.

    autopart compile tests/models/hf_gpt2.py -o out/hf_gpt2 --pp 2 --microbatches 4
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 128, 16
CONFIG = GPT2Config(
    vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


class GPT2Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt2 = GPT2LMHeadModel(CONFIG)

    def forward(self, tokens):
        return self.gpt2(input_ids=tokens).logits  # (B, T, vocab)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT2Logits()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
