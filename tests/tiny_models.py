"""The small language models that tests write as model files: ``token_model(preamble)`` is a
``Model`` of an embedding, two ``Block``s and a head, with the contract's ``build_model`` and
``example_batch``; the preamble gives the imports, ``D``, ``V``, ``T`` and the ``Block`` under
test, the test its ``loss_fn``."""

_MODEL = '''

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(V, D), nn.ModuleList(Block() for _ in range(2)), nn.Linear(D, V)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return OUTPUT


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    tokens = torch.randint(0, V, (batch_size, T + 1), generator=torch.Generator().manual_seed(1))
    return (tokens[:, :-1],), tokens[:, 1:]

'''


def token_model(preamble: str, *, output: str = "self.head(x)") -> str:
    """A model file's text but its ``loss_fn``: ``preamble``, then the model, whose forward returns ``output``."""
    return preamble + _MODEL.replace("OUTPUT", output)
