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


def beside_model(folder, *, meta: bool = False):
    """A model file, ``folder/beside.py``, whose layers come from a file beside it
    (``from layers import block``): three linears; built on the meta device where ``meta``."""
    (folder / "layers.py").write_text("import torch\n\ndef block():\n    return torch.nn.Linear(8, 8)\n")
    build = ("    with torch.device('meta'):\n        return " if meta else "    return ")
    model = folder / "beside.py"
    model.write_text("import torch\nfrom layers import block\n\ndef build_model():\n" + build +
                     "torch.nn.Sequential(block(), torch.nn.Tanh(), block(), torch.nn.Tanh(), block())\n"
                     "\ndef example_batch(b):\n    return (torch.randn(b, 8),), None\n"
                     "\ndef loss_fn(out, target):\n    return out.pow(2).mean()\n")
    return model
