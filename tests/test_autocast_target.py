"""Compile-time dtypes follow the target device's autocast: a plan made on this CPU for a GPU
holds the dtypes that CUDA autocast gives there, from the op lists of the installed torch."""

import torch

import autopart
from autopart.passes.autocast_lists import cuda_autocast, cuda_policies
from tests.distributed import run_cli_here

SOFTMAX_CHAIN = """
import torch
from torch import nn

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x):
        return torch.softmax(self.linear(x), dim=-1)  # (B, 32)

class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

def build_model():
    torch.manual_seed(0)
    return Chain()

def example_batch(batch_size):
    return (torch.randn(batch_size, 32),), torch.randn(batch_size, 32)

def loss_fn(output, target):
    return ((output - target) ** 2).mean()
"""


def test_cuda_lists_come_from_the_installed_torch():
    policies = cuda_policies()
    assert len(policies) > 80  # the header's four lists, not a short hand copy
    assert {policies[op] for op in ("linear", "mm", "bmm", "addmm", "matmul", "scaled_dot_product_attention")} == {"lower"}
    assert {policies[op] for op in ("layer_norm", "pow", "rsqrt", "nll_loss")} == {"fp32"}
    assert {policies[op] for op in ("softmax", "log_softmax", "sum", "cumsum")} == {"fp32_set_opt_dtype"}
    assert "gelu" not in policies and "add" not in policies  # run in whatever dtype their inputs have


def test_cuda_casts_differ_from_cpu_ones_where_torch_says_so():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with cuda_autocast(torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
        cuda = (y.dtype, torch.softmax(y, -1).dtype, y.pow(2).dtype, torch.nn.functional.gelu(y).dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
        cpu = (y.dtype, torch.softmax(y, -1).dtype, y.pow(2).dtype, torch.nn.functional.gelu(y).dtype)
    assert cuda == (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)
    assert cpu == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16)


def test_an_explicit_output_dtype_is_kept_as_cuda_autocast_keeps_it():
    """softmax and sum run in fp32 under CUDA autocast unless the call names its dtype: then
    torch leaves it alone (its fp32_set_opt_dtype policy)."""
    y = torch.randn(4, 8).bfloat16()
    with cuda_autocast(torch.bfloat16):
        named = (torch.softmax(y, -1, dtype=torch.bfloat16).dtype, y.sum(dtype=torch.bfloat16).dtype)
        unnamed = (torch.softmax(y, -1).dtype, y.sum().dtype, torch.nn.functional.softmax(y, dim=-1, dtype=None).dtype)
    assert named == (torch.bfloat16, torch.bfloat16)
    assert unnamed == (torch.float32,) * 3


def test_a_plan_for_a_gpu_sends_what_cuda_autocast_gives(tmp_path):
    model = tmp_path / "softmax_chain.py"
    model.write_text(SOFTMAX_CHAIN)
    sent = {}
    for device in ("cpu", "h100-sxm"):
        plan = autopart.compile(model, pp=2, microbatches=2, micro_batch_size=4, device=device, dtype="bf16",
                                stage_layers=(2, 2))  # a softmax's output crosses, wherever the costs would cut
        sent[device] = [meta.dtype for _, meta in plan.stages[0].outputs]
    assert sent == {"cpu": ["bfloat16"], "h100-sxm": ["float32"]}  # softmax of a bf16 product: fp32 on CUDA


TOP_K_ROUTER = """
import torch
from torch import nn
from torch.nn import functional as F

class Router(nn.Module):  # a mixture of experts' gates, as users write them
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        logits = self.router(x)  # (B, 4): bf16 under autocast
        top, index = torch.topk(logits, 2, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, index, F.softmax(top, dim=-1))  # softmax: fp32 on CUDA
        return sum(gates[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))

def build_model():
    torch.manual_seed(0)
    return Router()

def example_batch(batch_size):
    return (torch.randn(batch_size, 16),), torch.randn(batch_size, 16)

def loss_fn(output, target):
    return ((output - target) ** 2).mean()
"""


def test_an_op_that_cuda_autocast_gives_two_dtypes_is_refused_in_one_line(tmp_path):
    # CUDA autocast runs the softmax in fp32 and the linear in bf16: scatter refuses the two, on the
    # GPU as here, where annotate used to end in a RuntimeError traceback
    model = tmp_path / "router.py"
    model.write_text(TOP_K_ROUTER)
    result = run_cli_here("compile", str(model), "-o", str(tmp_path / "out"), "--dtype", "bf16", "--device", "h100-sxm",
                          "--global-batch-size", "4")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("autopart: error: under --dtype bf16 this model's op 'scatter' fails on the dtypes")
    assert "compile with --dtype fp32" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert autopart.compile(model, global_batch_size=4, device="h100-sxm").dtype == "fp32"  # the model itself is sound


def test_a_search_over_precisions_leaves_out_the_one_the_model_does_not_run_in(tmp_path, caplog):
    """--dtype auto: bf16 is refused for this model (above), so the search chooses among fp32's
    layouts and says why, where it ended on bf16's error."""
    import logging

    model = tmp_path / "router.py"
    model.write_text(TOP_K_ROUTER)
    with caplog.at_level(logging.INFO, logger="autopart"):
        plan = autopart.compile(model, world_size=2, global_batch_size=4, device="h100-sxm", dtype="auto")
    assert plan.dtype == "fp32"
    assert "the search leaves out bf16: under --dtype bf16 this model's op 'scatter' fails" in caplog.text


def test_a_search_over_precisions_of_a_model_of_repeated_layers_runs(tmp_path):
    """Its search costs a shallow copy of the model (a table of its own), whose precisions are
    tried as the full model's: an AttributeError, for every such model."""
    from tests.distributed import REPO

    model = tmp_path / "deep.py"
    model.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'benchmarks' / 'models')!r})\nfrom shallow import gpt3\n"
                     "MODEL = gpt3(n_embd=64, n_head=4, layers=8, seq_len=16, vocab_size=128)\n"
                     "build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, "
                     "MODEL.example_batch, MODEL.loss_fn\n")
    plan = autopart.compile(model, world_size=2, global_batch_size=8, device="h100-sxm", dtype="auto")
    assert plan.dtype in ("fp32", "bf16")
