"""A catalogue of bad inputs, first of three: model files and the compile's options (the others:
tests/test_bad_inputs_of_outputs.py, device TOMLs, output directories, plans, checkpoints, weights
and torchrun misuse; tests/test_bad_inputs_of_resources.py, memory, cores and GPUs). Each one ends as one line naming the problem and what
to do, exit code 2, no traceback, and nothing half-written or deleted: the folders it touches hold
exactly the files they held before (no output directory, no partial one beside it).

Most cases call the command line (or a rank's ``train.main``) in this process; a few run it as a
real subprocess, to show that no traceback reaches the terminal.
"""

import re
import textwrap

import pytest

from tests.distributed import run_cli
from tests.refusals import assert_nothing_written, call_cli

GOOD_BATCH = """
import torch
def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)
def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""
LINEAR = GOOD_BATCH + "\ndef build_model():\n    return torch.nn.Linear(8, 4)\n"
DATA_DEPENDENT = GOOD_BATCH + textwrap.dedent(
    """
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.linear(x)
            return -self.linear(x)

    def build_model():
        return Gate()
    """
)
NO_INITIALISER = GOOD_BATCH + textwrap.dedent(
    """
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4))

        def forward(self, x):
            return x * self.weight

    def build_model():
        with torch.device("meta"):
            return torch.nn.Sequential(torch.nn.Linear(8, 4), Scale())
    """
)

SCALAR = GOOD_BATCH + textwrap.dedent(
    """
    class Tempered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)
            self.temperature = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.linear(x) / self.temperature

    def build_model():
        return Tempered()
    """
)

BUFFER_GIVEN_A_GRADIENT = GOOD_BATCH + textwrap.dedent(
    """
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(8))
            self.register_buffer("last_scale", torch.zeros(8))
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            self.last_scale.copy_(self.scale * 2)
            return self.linear(x * self.last_scale)

    def build_model():
        return Scaled()
    """
)

BUFFER_GIVEN_A_GRADIENT_REFUSED = (
    r"the model's buffer 'last_scale' holds a value computed from trained parameters \(written in forward or in "
    r"__init__\), so it keeps that autograd graph and the next backward runs through it again \(it fails in the "
    r"model's own training loop too\); write a detached value \(\.copy_\(value\.detach\(\)\)\), or keep the value "
    r"a plain tensor of the forward rather than a buffer"
)

# name -> (model source or None for a missing file, extra arguments, pattern of the one line)
MODEL_CASES = {
    "missing": (None, [], r"model file '.*missing\.py' does not exist"),
    "no_build_model": (GOOD_BATCH, [], r"does not define build_model\(\); add `def build_model\(\) -> nn.Module`"),
    "raises_on_import": (
        "import torch\nraise ValueError('bad config')\n",
        [],
        r"importing raises_on_import\.py failed: ValueError: bad config \(raises_on_import\.py:2\)",
    ),
    "raises_in_build_model": (
        GOOD_BATCH + "\ndef build_model():\n    return torch.nn.Linear(8, -4)\n",
        [],
        r"build_model\(\) in raises_in_build_model\.py raised RuntimeError: .*negative dimension.*\(raises_in_build_model\.py:9\); "
        r"fix build_model\(\)$",
    ),
    "raises_in_example_batch": (
        LINEAR.replace("    return (torch.randn(batch_size, 8),)", "    raise KeyError('x')\n    return (torch.randn(batch_size, 8),)"),
        [],
        r"example_batch\(\d+\) in raises_in_example_batch\.py raised KeyError: 'x' \(raises_in_example_batch\.py:4\); fix example_batch\(\)",
    ),
    "exits_on_import": (  # the compile ended with the file's exit code, 0 here, and no word
        "import sys\nsys.exit(0)\n",
        [],
        r"importing exits_on_import\.py failed: SystemExit\(0\) \(exits_on_import\.py:2\); the file exits as it is "
        r"imported; keep what it does as a script under if __name__ == '__main__':$",
    ),
    "exits_in_build_model": (GOOD_BATCH + "\ndef build_model():\n    raise SystemExit(3)\n", [],
                             r"build_model\(\) in exits_in_build_model\.py raised SystemExit\(3\) "
                             r"\(exits_in_build_model\.py:9\); fix build_model\(\)$"),
    "nothing_trains": (  # compiled; its programs failed at the first backward ('does not require grad')
        GOOD_BATCH + "\ndef build_model():\n    return torch.nn.Linear(8, 4).requires_grad_(False)\n",
        [],
        r"the loss of nothing_trains\.py takes no gradient from any parameter that trains \(.*\), so training could "
        r"change nothing; return a floating-point loss computed from the model's output, with requires_grad on",
    ),
    "no_parameters": (  # a KeyError of the stage generator, in a traceback
        GOOD_BATCH.replace("torch.randn(batch_size, 4)", "torch.randn(batch_size, 8)")
        + "\ndef build_model():\n    return torch.nn.ReLU()\n",
        [],
        r"the loss of no_parameters\.py takes no gradient from any parameter that trains",
    ),
    "detached_loss": (
        LINEAR.replace("mse_loss(output, target)", "mse_loss(output.detach(), target)"),
        [],
        r"the loss of detached_loss\.py takes no gradient",
    ),
    "integer_loss": (
        LINEAR.replace("return torch.nn.functional.mse_loss(output, target)", "return (output > target).sum()"),
        [],
        r"the loss of integer_loss\.py takes no gradient",
    ),
    "loss_of_an_integer_made_midway": (  # the capture's rule, without values, passes it; the annotation's refuses
        LINEAR.replace("return torch.nn.functional.mse_loss(output, target)",
                       "return (output.argmax(-1) == target.argmax(-1)).float().mean()"),
        [],
        r"the loss of loss_of_an_integer_made_midway\.py takes no gradient",
    ),
    "build_model_an_instance": (  # callable: build_model() ran the Linear's forward, and said it missed an input
        GOOD_BATCH + "\nbuild_model = torch.nn.Linear(8, 4)\n", [],
        r"build_model in build_model_an_instance\.py is a Linear instance, not a function that returns the model; "
        r"define it with def, as `def build_model\(\): return Linear\(\.\.\.\)`$",
    ),
    "example_batch_of_three": (  # the inputs one by one: the line said only that it "returned tuple"
        LINEAR.replace("return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)",
                       "return torch.randn(batch_size, 8), torch.randn(batch_size, 8), torch.randn(batch_size, 4)"), [],
        r"example_batch\(\) in example_batch_of_three\.py returned a tuple of 3 items; it must return two, \(inputs: "
        r"tuple, target\): the model's inputs in one tuple, then the target$",
    ),
    "returns_not_a_module": (GOOD_BATCH + "\ndef build_model():\n    return 3\n", [], r"returned int, not a torch\.nn\.Module"),
    "contract_not_a_function": (
        LINEAR.replace("def example_batch(batch_size):", "example_batch = 3\ndef _unused(batch_size):"),
        [],
        r"example_batch in contract_not_a_function\.py is a int, not a function; define it with def",
    ),
    "bad_example_batch": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(8, 4)\ndef example_batch(b):\n    return torch.randn(b, 8)\n",
        [],
        r"example_batch\(\) in bad_example_batch\.py returned Tensor; it must return \(inputs: tuple, target\)",
    ),
    "batch_not_first": (
        LINEAR.replace("torch.randn(batch_size, 8)", "torch.randn(8, batch_size)"),
        [],
        r"example_batch\(2\) in batch_not_first\.py: input 0 has shape \(8, 2\), whose first dimension is not the batch size 2",
    ),
    "batch_on_the_meta_device": (
        LINEAR.replace("torch.randn(batch_size, 8)", "torch.randn(batch_size, 8, device='meta')"),
        [],
        r"example_batch\(\) in batch_on_the_meta_device\.py: input 0 is on the meta device; return tensors on the CPU",
    ),
    "module_backward_hook": (
        GOOD_BATCH + "\ndef build_model():\n    m = torch.nn.Sequential(torch.nn.Linear(8, 4))\n"
        "    m[0].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,))\n    return m\n",
        [],
        r"module '0' \(Linear\) of module_backward_hook\.py has a backward hook, which the generated stages cannot run",
    ),
    "parameter_gradient_hook": (
        GOOD_BATCH + "\ndef build_model():\n    m = torch.nn.Linear(8, 4)\n    m.weight.register_hook(lambda g: g * 10)\n"
        "    return m\n",
        [],
        r"parameter 'weight' of parameter_gradient_hook\.py has a gradient hook \(register_hook\)",
    ),
    "model_rejects_batch": (
        LINEAR.replace("torch.randn(batch_size, 8)", "torch.randn(batch_size, 5)"),
        [],
        r"the model rejects its own example batch: RuntimeError: .*; make example_batch\(\) match the model's forward",
    ),
    "loss_fn_of_one_argument": (  # the example batch went through the model: blaming it sent the user astray
        LINEAR.replace("def loss_fn(output, target):", "def loss_fn(output):"),
        [],
        r"loss_fn\(output, target\) in loss_fn_of_one_argument\.py raised TypeError: loss_fn\(\) takes 1 positional "
        r"argument but 2 were given; fix loss_fn so that it takes the model's output and the target",
    ),
    "model_returns_a_dict": (
        GOOD_BATCH + "\nclass M(torch.nn.Linear):\n    def forward(self, x):\n        return {'y': super().forward(x)}\n"
        "def build_model():\n    return M(8, 4)\n",
        [],
        r"loss_fn\(output, target\) in model_returns_a_dict\.py raised AttributeError: 'dict' object has no attribute "
        r"'size' \(model_returns_a_dict\.py:6\), given the dict that the model's forward returns; fix loss_fn",
    ),
    "loss_nan": (  # the graph's check compared nan with nan and put it down to tracing
        LINEAR.replace("mse_loss(output, target)", "mse_loss(output, target) * float('nan')"),
        [],
        r"the loss of loss_nan\.py on example_batch\(\) is nan with the weights build_model\(\) gives: its forward or "
        r"loss_fn computes a value that is not finite .*; fix the model so that its loss is finite",
    ),
    "loss_not_scalar": (
        LINEAR.replace("mse_loss(output, target)", "mse_loss(output, target, reduction='none')"),
        [],
        r"the loss of loss_not_scalar\.py is not a scalar tensor; define loss_fn",
    ),
    "neither_fx_nor_export": (
        DATA_DEPENDENT,
        [],
        r"neither torch\.fx \(Python control flow on a traced shape or tensor at neither_fx_nor_export\.py:14\) nor "
        r"torch\.export could capture neither_fx_nor_export\.py: control flow on tensor values at neither_fx_nor_export\.py:14",
    ),
    "fx_forced_on_untraceable": (
        DATA_DEPENDENT,
        ["--capture", "fx"],
        r"torch\.fx could not trace fx_forced_on_untraceable\.py: .* at fx_forced_on_untraceable\.py:14; .*--capture export",
    ),
    "unknown_leaf_class": (LINEAR, ["--leaf", "Mixer"], r"--leaf Mixer: the model has no module of that class; its classes include Linear"),
    "meta_without_initialiser": (
        NO_INITIALISER,
        [],
        r"builds the model on the meta device, but module '1' \(Scale\) has no reset_parameters\(\) and "
        r"meta_without_initialiser\.py defines no init_weights\(module\)",
    ),
    "not_a_python_file": (LINEAR, [], r"is not a \.py file"),
    "forward_writes_a_buffer_it_reads": (
        GOOD_BATCH + textwrap.dedent(
            """
            class Centred(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.linear = torch.nn.Linear(8, 4)
                    self.register_buffer("mean", torch.zeros(4))

                def forward(self, x):
                    y = self.linear(x)
                    self.mean.mul_(0.5).add_(y.detach().mean(0), alpha=0.5)
                    return y - self.mean

            def build_model():
                return Centred()
            """
        ),
        [],
        r"the model's forward changes its buffer 'mean' and reads it back, so each run computes another loss",
    ),
    "buffer_filled_on_the_first_run_only": (  # the stages started from the unfilled cache, in silence, before
        GOOD_BATCH + textwrap.dedent(
            """
            class Cached(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.linear = torch.nn.Linear(8, 4)
                    self.register_buffer("table", torch.zeros(4))
                    self.filled = False

                def forward(self, x):
                    if not self.filled:
                        self.table.copy_(torch.arange(4.0))
                        self.filled = True
                    return self.linear(x) * self.table

            def build_model():
                return Cached()
            """
        ),
        [],
        r"the model's forward fills its buffer 'table' on its first run only \(behind a Python flag or check, .*\), "
        r"and the stages start from the buffers as built; "
        r"fill it in build_model\(\) or in the module's __init__",
    ),
    "loss_summed_over_the_batch": (  # trained with gradients 1/4 of the model's, in silence, before
        LINEAR.replace("mse_loss(output, target)", "mse_loss(output, target, reduction='sum')"),
        ["--microbatches", "4", "--no-measure"],
        r"the loss of loss_summed_over_the_batch\.py sums over the batch \(the loss of two samples is the sum of each "
        r"one's\), and the plan splits each batch of 8 into 4 of 2 and averages their losses, so it would train with "
        r"gradients 1/4 of the model's; make it a mean over the batch \(reduction='mean', or divide by the batch size\)",
    ),
    "buffer_given_a_parameter_s_gradient": (  # the op timing's second backward failed in a traceback, before
        BUFFER_GIVEN_A_GRADIENT,
        [],
        BUFFER_GIVEN_A_GRADIENT_REFUSED,
    ),
    "buffer_given_a_parameter_s_gradient_unmeasured": (  # compiled, and its programs failed at the second B
        BUFFER_GIVEN_A_GRADIENT,
        ["--no-measure"],
        BUFFER_GIVEN_A_GRADIENT_REFUSED,
    ),
    "batch_norm_of_a_cumulative_average": (  # 'control flow on tensor values' at the line that calls it, before
        GOOD_BATCH + "\ndef build_model():\n    return torch.nn.Sequential(torch.nn.Linear(8, 4), "
                     "torch.nn.BatchNorm1d(4, momentum=None))\n",
        [],
        r"module '1' \(BatchNorm1d\) of batch_norm_of_a_cumulative_average\.py has momentum=None, .*; give it a "
        r"momentum \(0\.1 is BatchNorm's default\), or keep it whole with --leaf BatchNorm1d",
    ),
    "scalar_parameter_zero3": (SCALAR, ["--pp", "1", "--dp", "2", "--zero", "3"],
                               r"--zero 3 shards parameters with FSDP's fully_shard, which refuses the 0-dim parameter "
                               r"'temperature'; make it a tensor of one element"),
    "scalar_parameter_zero2_searched": (SCALAR, ["--pp", "1", "--world-size", "2", "--zero", "2",
                                                 "--global-batch-size", "8"],
                                        r"--zero 2 shards parameters with FSDP's fully_shard, which refuses the 0-dim"),
}

OPTION_CASES = {
    "batch_does_not_divide": (["--global-batch-size", "10", "--microbatches", "4"], r"the global batch \(10\) is not a whole number of microbatches"),
    "pins_of_more_devices": (["--world-size", "2", "--dp", "2", "--global-batch-size", "8"],  # and --pp 2: a list of
                             r"--pp 2 x --dp 2 = 4 does not divide --world-size 2: pp x tp x dp must equal the world "
                             r"size; change a pin or --world-size$"),  # every reason a layout may fail said nothing
    "pins_of_all_three": (["--world-size", "4", "--tp", "1", "--dp", "1", "--global-batch-size", "8"],
                          r"--pp 2 x --tp 1 x --dp 1 = 2 is not --world-size 4"),
    "interleaved_of_no_chunks": (["--schedule", "interleaved", "--chunks", "0"],  # it said: needs --schedule interleaved
                                 r"--chunks must be at least 2, got 0$"),
    "negative_chunks": (["--chunks", "-1"], r"--chunks must be at least 1, got -1$"),
    "interleaved_does_not_divide": (
        ["--schedule", "interleaved", "--chunks", "2", "--microbatches", "3", "--global-batch-size", "6"],
        r"interleaved needs microbatches \(3\) to be a multiple of the pipeline degree \(2\); use --microbatches 2$",
    ),  # 4, the next multiple of 2, is no whole number of microbatches of 6
    "zbv_too_few_for_the_batch": (
        ["--schedule", "zbv", "--microbatches", "1", "--global-batch-size", "7"],
        r"zbv needs at least 2 x pp - 1 = 3 microbatches to fill its V \(got 1\); use --microbatches 7$",
    ),
    "interleaved_no_count_divides": (
        ["--schedule", "interleaved", "--chunks", "2", "--global-batch-size", "3"],
        r"interleaved needs microbatches \(1\) .*; use a --global-batch-size whose share per data-parallel replica "
        r"\(3 now\) has such a count$",
    ),
    "more_stages_than_blocks": (["--pp", "64"], r"places where a pipeline stage can start but 64 stages were asked for; use --pp \d+ or fewer"),
    "unknown_device": (["--device", "tpu-v9"], r"unknown device 'tpu-v9'; known devices: .*h100-sxm"),
    "unknown_schedule": (["--schedule", "zigzag"], r"unknown schedule 'zigzag'; use one of gpipe"),
    "out_of_memory": (
        ["--memory", "0.0001"],
        r"the model does not fit: .* the fullest device needs 0\.\d+ GiB but the memory limit is 0\.0001 GiB; raise --memory to at least 0\.\d+ or",
    ),
    "bad_flag_value": (["--pp", "two"], r"argument --pp: invalid int value: 'two'"),
    "memory_nan": (["--memory", "nan"], r"--memory must be a positive number of GiB, at most 1073741824, got nan"),
    "memory_infinite": (["--memory", "inf"], r"--memory must be a positive number of GiB, at most 1073741824, got inf"),
    "memory_past_a_float_of_bytes": (["--memory", "1e300"],  # its bytes overflowed an integer, in a traceback
                                     r"--memory must be a positive number of GiB, at most 1073741824, got 1e\+300"),
    "pp_past_any_cluster": (["--pp", str(10**20)],  # an OverflowError listing its stages (10**9: out of memory)
                            r"--pp 100000000000000000000 is more than any cluster holds; give at most 1048576$"),
    "stages_past_any_cluster": (["--schedule", "interleaved", "--pp", "1048576", "--chunks", "2"],
                                r"--pp x --chunks is 2097152 stages, more than any cluster holds; give at most 1048576$"),
    "stage_layers_count": (["--stage-layers", "1,1,1"], r"--stage-layers lists 3 stages but --pp x --chunks is 2"),
    "stage_layers_empty_stage": (["--stage-layers", "2,0"], r"--stage-layers gives stage 1 0 layers; every stage needs"),
    "stage_layers_not_numbers": (["--stage-layers", "2,x"], r"--stage-layers takes whole numbers separated by commas"),
    "stage_layers_with_search": (["--stage-layers", "1,1", "--world-size", "2", "--global-batch-size", "8"],
                                 r"--stage-layers pins the cuts of a layout given in full; drop --world-size"),
    "first_stage_layers_with_stage_layers": (["--stage-layers", "1,1", "--first-stage-layers", "1"],
                                             r"--stage-layers gives every stage's count; drop --first-stage-layers"),
    "last_stage_layers_one_stage": (["--pp", "1", "--last-stage-layers", "1"],
                                    r"sets the first or last pipeline stage apart, and there is one stage; add --pp 2"),
    "first_stage_layers_zero": (["--first-stage-layers", "0"], r"gives a stage 0 layers; every stage needs at least one"),
    "stage_layers_with_plan": (["--stage-layers", "1,1", "--plan", "plan.json"],
                               r"--stage-layers pins the cuts that --plan already records; drop one of them"),
    "search_without_global_batch": (["--world-size", "3"], r"the search needs the global batch: add --global-batch-size"),
    "time_limit_not_positive": (["--time-limit", "0"], r"--time-limit must be a positive number of seconds, got 0"),
    "sp_without_tensor_parallelism": (["--sp"], r"--sp splits what tensor parallelism computes, and this compile has "
                                                r"none \(tensor parallelism 1\); add --tp 2 or more, or drop --sp$"),
    "sp_where_the_pins_leave_tp_1": (["--world-size", "2", "--pp", "2", "--global-batch-size", "4", "--sp"],
                                     r"--sp splits what tensor parallelism computes, and this compile has none"),
    "tp_overlap_with_tp_1": (["--tp", "1", "--tp-overlap"], r"--tp-overlap splits what tensor parallelism computes, .*"
                                                           r"add --tp 2 or more, or drop --tp-overlap$"),
    "profile_pipeline_without_costs": (
        ["--profile-pipeline"], r"--profile-pipeline keeps what it measures in a cost database: add --costs COSTS.json"
    ),
    "profile_pipeline_of_another_device": (
        ["--profile-pipeline", "--costs", "costs.json", "--device", "h100-sxm"],
        r"--profile-pipeline runs the plan on this machine's CPU, so it profiles plans for --device cpu, not h100-sxm",
    ),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model_file(tmp_path, capsys, case):
    source, extra, pattern = MODEL_CASES[case]
    model = tmp_path / (f"{case}.txt" if case == "not_a_python_file" else f"{case}.py")
    if source is not None:
        model.write_text(source)
    out = tmp_path / "out"
    line = call_cli(capsys, "compile", str(model), "-o", str(out), "--pp", "2", *extra, watch=(tmp_path,))
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, out)


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_bad_options(tmp_path, capsys, case):
    extra, pattern = OPTION_CASES[case]
    model = tmp_path / "linear.py"
    model.write_text(LINEAR)
    out = tmp_path / "out"
    line = call_cli(capsys, "compile", str(model), "-o", str(out), "--pp", "2", *extra, watch=(tmp_path,))
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, out)


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["compile", "{tmp}/missing.py", "-o", "{tmp}/out"], r"model file '.*missing\.py' does not exist"),
        (["compile", "{tmp}/gate.py", "-o", "{tmp}/out", "--pp", "2"], r"neither torch\.fx .* nor torch\.export could capture gate\.py"),
    ],
)
def test_no_traceback_reaches_the_terminal(tmp_path, argv, pattern):
    (tmp_path / "gate.py").write_text(DATA_DEPENDENT)
    result = run_cli(*(a.format(tmp=tmp_path) for a in argv))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert_nothing_written(tmp_path, tmp_path / "out")
