"""BERT from Hugging Face transformers (5.x), a tiny random-initialised config, wrapped as a user
would: a masked-language-model module that takes token ids and an attention mask and returns the
logits.

    autopart compile tests/models/hf_bert.py -o out/hf_bert --pp 2 --microbatches 4
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import BertConfig, BertForMaskedLM

VOCAB, SEQ = 128, 16
CONFIG = BertConfig(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip


class BertLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.bert = BertForMaskedLM(CONFIG)

    def forward(self, tokens, attention_mask):
        return self.bert(input_ids=tokens, attention_mask=attention_mask).logits  # (B, T, vocab)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return BertLogits()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)
    mask = torch.ones(batch_size, SEQ, dtype=torch.int64)
    mask[:, SEQ - 3 :] = 0  # padding at the end of every sequence
    return (tokens, mask), tokens


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
