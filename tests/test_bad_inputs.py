"""A catalogue of bad inputs: model files, flags, plans, device TOMLs, output directories,
checkpoints, weights and torchrun misuse. Each one ends as one line naming the problem and what
to do, exit code 2, no traceback, and nothing half-written or deleted: the folders it touches hold
exactly the files they held before (no output directory, no partial one beside it).

Most cases call the command line (or a rank's ``train.main``) in this process; a few run it as a
real subprocess, to show that no traceback reaches the terminal.
"""

import hashlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopart.ir.errors import gib_beside
from autopart.tools import cli
from autopart.runtime import train
from cost_models.devices import DEVICES_DIR
from tests.distributed import REPO, environment, run_cli

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


def snapshot(*folders: Path) -> dict[Path, str]:
    """Every file under ``folders`` with the hash of its bytes (Python's bytecode caches aside)."""
    return {
        path: hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in folders for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def refused(capsys, run, *watch: Path) -> str:
    """``run()`` must exit 2 with one line and no traceback, and leave every file of ``watch`` as it was."""
    before = snapshot(*watch)
    with pytest.raises(SystemExit) as exit_info:
        run()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, repr(err)  # no empty line either (a progress bar's)
    assert lines[0].startswith("autopart: error: ")
    assert snapshot(*watch) == before, "a file was written, changed or deleted"
    return lines[0]


def call_cli(capsys, *argv: str, watch: tuple[Path, ...] = ()) -> str:
    """Run the command line in this process; return its one stderr line, having checked the contract."""
    return refused(capsys, lambda: cli.main(list(argv)), *watch)


def assert_nothing_written(folder: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in folder.iterdir() if p.name.startswith(f".{out.name}")], "a partial output was left"


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


H100 = (DEVICES_DIR / "h100-sxm.toml").read_text()
DEVICE_CASES = {  # name -> (the file's text, or None for no file; the pattern of the one line)
    "not_toml": ("name = 'mygpu'\npeak_flops = [oops\n", r"mygpu\.toml: not valid TOML .*; fix the file"),
    "not_text": (b"\x80\x04\x95 not text", r"mygpu\.toml: not valid TOML \('utf-8' codec can't decode .*; fix the file"),
    "negative_bandwidth": (H100.replace("memory_bandwidth = 3.35e12", "memory_bandwidth = -1"),
                           r"field 'memory_bandwidth' must be a positive number"),
    "misspelt_field": (H100.replace("memory_bandwidth = 3.35e12", "memory_bandwith = 3.35e12"),
                       r"field 'memory_bandwith' is not a device spec field"),
    "unknown_kind": (H100.replace('kind = "cuda"', 'kind = "tpu"'), r"field 'kind' must be one of cuda, rocm, cpu"),
    "no_such_file": (None, r"does not exist"),
}


@pytest.mark.parametrize("case", sorted(DEVICE_CASES))
def test_bad_device_spec(tmp_path, capsys, case):
    text, pattern = DEVICE_CASES[case]
    spec = tmp_path / "mygpu.toml"
    if text is not None:
        spec.write_bytes(text) if isinstance(text, bytes) else spec.write_text(text)
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(tmp_path / "out"), "--device", str(spec),
                    watch=(tmp_path,))
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


def _thesis(out: Path) -> None:  # the case that once lost a thesis: any plan.json made a folder autopart's
    out.mkdir()
    (out / "thesis.txt").write_text("four years")
    (out / "plan.json").write_text("")


def _link_out(out: Path) -> None:
    (out.parent / "elsewhere").mkdir()
    (out.parent / "elsewhere" / "data.txt").write_text("mine")
    out.symlink_to(out.parent / "elsewhere")


OUTPUT_CASES = {
    "other_files": (lambda out: (out.mkdir(), (out / "notes.txt").write_text("mine")), r"holds files but no \.autopart-output\.json"),
    "thesis_beside_an_empty_plan": (_thesis, r"holds files but no \.autopart-output\.json"),
    "a_file": (lambda out: out.write_text("mine"), r"is a file; choose a directory path for -o"),
    "a_link": (_link_out, r"is a symbolic link; give the directory itself with -o"),
    "under_a_file": (lambda out: out.write_text("mine"), r"-o .*run lies under .*out, which is a file; give a path under a folder"),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_output_path_that_autopart_did_not_write_is_left_alone(tmp_path, capsys, case):
    make, pattern = OUTPUT_CASES[case]
    make(tmp_path / "out")
    out = tmp_path / "out" / "run" if case == "under_a_file" else tmp_path / "out"
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(out), "--pp", "2", watch=(tmp_path,))
    assert re.search(pattern, line), line


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """One small compiled output directory, shared by the plan and weights cases."""
    out = tmp_path_factory.mktemp("compiled") / "out"
    cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--pp", "2", "--microbatches", "2"])
    return out


def _edited_plan(compiled: Path, edit) -> str:
    data = json.loads((compiled / "plan.json").read_text())
    edit(data)
    return json.dumps(data)


PLAN_CASES = {  # name -> (the plan's text, given the compiled output; the pattern of the one line)
    "not_json": (lambda out: "{ not json", r"bad\.json is not valid JSON .*; fix it or recompile"),
    "nested_past_the_parser": (lambda out: "[" * 100000 + "]" * 100000,  # a RecursionError, in a traceback
                               r"bad\.json is not valid JSON \(maximum recursion depth exceeded.*\); fix it or recompile"),
    "integer_past_the_parser": (lambda out: '{"version": ' + "9" * 5000 + "}",  # a ValueError, in a traceback
                                r"bad\.json is not valid JSON \(Exceeds the limit \(4300 digits\).*; fix it or recompile"),
    "missing_field": (lambda out: '{"version": 1}', r"plan\.mesh is missing; the plan is incomplete"),
    "wrong_version": (lambda out: '{"version": 99}', r"plan version 99 is not supported"),
    "rank_5_of_2_stages": (lambda out: _edited_plan(out, lambda d: d["stages"][1].update(rank=5)),
                           r"plan\.stages\[1\]\.rank is 5 but plan\.mesh\.pp is 2"),
    "three_stages_named_two": (lambda out: _edited_plan(out, lambda d: d["mesh"].update(pp=3)),
                               r"plan\.stages lists 2 stages but plan\.mesh\.pp x plan\.schedule\.chunks is 3 x 1"),
    "blocks_that_do_not_fit": (lambda out: _edited_plan(out, lambda d: d["stages"][1].update(blocks=[1, 1])),
                               r"plan\.stages\[1\]\.blocks is \[1, 1\] but this model"),
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_bad_plan(tmp_path, capsys, compiled, case):
    text, pattern = PLAN_CASES[case]
    plan = tmp_path / "bad.json"
    plan.write_text(text(compiled))
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(tmp_path / "out"), "--plan", str(plan),
                    watch=(tmp_path,))
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_plan_of_another_model(tmp_path, capsys, compiled):
    line = call_cli(capsys, "compile", "examples/llama.py", "-o", str(tmp_path / "out"), "--plan",
                    str(compiled / "plan.json"), watch=(tmp_path, compiled))
    assert re.search(r"plan\.json was compiled from another version of llama\.py .*; recompile without --plan", line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("pins, pattern", [
    (["--pp", "4"], r"--pp 4 contradicts plan\.json, which --plan emits as it is \(pp 2\); drop --pp, or recompile without --plan"),
    (["--microbatches", "4"], r"--microbatches 4 contradicts plan\.json, .*\(microbatches 2\)"),
    (["--dtype", "bf16"], r"--dtype bf16 contradicts plan\.json, .*\(dtype fp32\)"),
    (["--world-size", "8", "--global-batch-size", "64"], r"--world-size 8 contradicts plan\.json, .*\(world_size 2\)"),
    (["--sp"], r"--sp contradicts plan\.json, .*\(sp False\); drop --sp, or recompile without --plan"),
    (["--tp-overlap"], r"--tp-overlap contradicts plan\.json, .*\(tp_overlap False\)"),
    (["--recompute", "full"], r"--recompute full contradicts plan\.json, .*\(recompute none,none\); drop --recompute,"),
], ids=["pp", "microbatches", "dtype", "world_size", "sp", "tp_overlap", "recompute"])
def test_a_pin_that_the_plan_contradicts(tmp_path, capsys, compiled, pins, pattern):
    """--plan emits the plan as it is: a pin it contradicts was dropped without a word."""
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(tmp_path / "out"), "--plan",
                    str(compiled / "plan.json"), *pins, watch=(tmp_path, compiled))
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


def _weights_lacking_one(folder: Path, out: Path) -> list[str]:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "weights" / "stage_0.safetensors"))
    save_file({k: v for k, v in weights.items() if k != sorted(weights)[0]}, str(folder / "partial.safetensors"))
    return ["--weights", str(folder / "partial.safetensors")]


def _weights_of_another_shape(folder: Path, out: Path) -> list[str]:
    """Stage 0's weights with one cut short: a rank copying it failed on a bare size mismatch."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "weights" / "stage_0.safetensors"))
    name = "h.0.attn.c_attn.weight"
    save_file({**weights, name: weights[name][:10].contiguous()}, str(folder / "other.safetensors"))
    return ["--weights", str(folder / "other.safetensors")]


def _not_safetensors(folder: Path, out: Path) -> list[str]:
    (folder / "w.safetensors").write_text("not a checkpoint")
    return ["--weights", str(folder / "w.safetensors")]


def _a_file(path: Path, folder: bool = False) -> list[str]:
    if folder:
        path.parent.mkdir()
    path.write_text("mine")
    return []


def _binary(path: Path) -> Path:
    path.write_bytes(b"\x80\x04\x95 not text")  # what a pickle starts with
    return path


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _dangling(path: Path) -> list[str]:
    path.symlink_to(path.parent / "nowhere")
    return []


TRAIN_CASES = {  # name -> (environment, arguments given (folder, OUT), pattern of the one line)
    "wrong_world_size": ({"WORLD_SIZE": "3"}, lambda f, o: [], r"the plan needs 2 processes but 3 were started"),
    "without_torchrun": ({"WORLD_SIZE": None, "RANK": None}, lambda f, o: [],
                         r"the plan needs 2 processes but 1 was started; run torchrun --nproc-per-node 2"),
    "misspelt_flag": ({}, lambda f, o: ["--stpes", "3"], r"unrecognized arguments: --stpes 3; see 'train\.py --help'"),
    "zero_steps": ({}, lambda f, o: ["--steps", "0"], r"--steps must be at least 1, got 0"),
    "zero_min_steps": ({}, lambda f, o: ["--seconds", "1", "--min-steps", "0"], r"--min-steps must be at least 1, got 0"),
    "min_steps_without_seconds": ({}, lambda f, o: ["--min-steps", "3"],
                                  r"--min-steps counts toward --seconds S; give --seconds too, or drop it"),
    "untimed_steps_without_seconds": ({}, lambda f, o: ["--untimed-steps", "3"],
                                      r"--untimed-steps counts toward --seconds S; give --seconds too, or drop it"),
    "negative_untimed_steps": ({}, lambda f, o: ["--seconds", "1", "--untimed-steps", "-1"],
                               r"--untimed-steps must be at least 0, got -1"),
    "negative_seconds": ({}, lambda f, o: ["--seconds", "-1"], r"--seconds must be a number of seconds, at least 0, got -1"),
    "seconds_with_trace": ({}, lambda f, o: ["--seconds", "1", "--trace", str(f / "t.json")],
                           r"--trace records the last of --steps, which --seconds may not reach; give one of them"),
    "nan_timeout": ({}, lambda f, o: ["--timeout", "nan"],  # the refusal's own wait took it, and failed in a traceback
                    r"--timeout must be a positive number of seconds, at most 31536000 \(a year\), got nan$"),
    "infinite_timeout": ({}, lambda f, o: ["--timeout", "inf"], r"--timeout must be a positive number of seconds, .*got inf"),
    "seed_past_64_bits": ({}, lambda f, o: ["--seed", str(10**20)],
                          r"--seed must lie between -2\*\*40 and 2\*\*40 \(1099511627776\), got 10{20}; give a smaller"),
    "negative_checkpoint_every": ({}, lambda f, o: ["--checkpoint-dir", str(f / "c"), "--checkpoint-every", "-1"],
                                  r"--checkpoint-every must be at least 0, got -1"),
    "metrics_under_a_file": ({}, lambda f, o: _a_file(f / "notes") + ["--metrics", str(f / "notes" / "m.jsonl")],
                             r"--metrics .*m\.jsonl lies under .*notes, which is a file; give a path under a folder"),
    "metrics_a_folder": ({}, lambda f, o: ["--metrics", str(f)], r"--metrics .* is a folder; give the path of a file"),
    "save_weights_a_file": ({}, lambda f, o: _a_file(f / "w") + ["--save-weights", str(f / "w")],
                            r"--save-weights .*w is a file; give the path of a folder"),
    "negative_lr": ({}, lambda f, o: ["--lr", "-1"], r"--lr must be a finite learning rate, at least 0, got -1"),
    "nan_lr": ({}, lambda f, o: ["--lr", "nan"], r"--lr must be a finite learning rate, at least 0, got nan"),
    "betas_not_two_rates": ({}, lambda f, o: ["--betas", "0.9"], r"^autopart: error: argument --betas: takes two rates "
                            r"with a comma between them \(0\.9,0\.95\), got '0\.9'; see 'train\.py --help'$"),
    "nan_min_lr": ({}, lambda f, o: ["--min-lr", "nan"], r"--min-lr must be a finite rate, at least 0, got nan"),
    "nan_weight_decay": ({}, lambda f, o: ["--weight-decay", "nan"], r"--weight-decay must be finite, at least 0, got nan"),
    "infinite_lr": ({}, lambda f, o: ["--lr", "inf"], r"--lr must be a finite learning rate, at least 0, got inf"),
    "metrics_under_a_link_to_nothing": ({}, lambda f, o: _dangling(f / "gone") + ["--metrics", str(f / "gone" / "m.jsonl")],
                                        r"--metrics .*m\.jsonl: .*gone is a link to nothing"),
    "min_lr_above_lr": ({}, lambda f, o: ["--lr-schedule", "cosine", "--min-lr", "0.1"],
                        r"--min-lr 0\.1 is above --lr 0\.001, so --lr-schedule cosine would raise the rate"),
    "checkpoint_every_without_dir": ({}, lambda f, o: ["--checkpoint-every", "2"],
                                     r"--checkpoint-every saves into --checkpoint-dir DIR; give it too"),
    "eval_batches_without_eval_every": ({}, lambda f, o: ["--eval-batches", "4"],
                                        r"--eval-batches counts the held-out batches of each --eval-every K"),
    "save_weights_beside_another_plan_s": ({}, lambda f, o: _a_file(f / "w" / "stage_3.safetensors", folder=True)
                                           + ["--save-weights", str(f / "w")],
                                           r"--save-weights .*w holds stage_3\.safetensors, which this plan \(2 stages, "
                                           r"tp 1\) does not write"),
    "trace_over_the_user_s_file": ({}, lambda f, o: _a_file(f / "model.py") + ["--trace", str(f / "model.py")],
                                   r"--trace .*model\.py exists and is not a Chrome trace that train\.py wrote; give a new "
                                   r"path, or move the file away first"),
    "metrics_appended_to_the_user_s_file": ({}, lambda f, o: _a_file(f / "notes.txt") + ["--metrics", str(f / "notes.txt")],
                                            r"--metrics .*notes\.txt exists and is not JSON lines of steps that train\.py "
                                            r"wrote"),
    "metrics_appended_to_the_plan": ({}, lambda f, o: ["--metrics", str(o / "plan.json")],
                                     r"--metrics .*plan\.json would write over plan\.json, which autopart compile wrote in "),
    "trace_over_train_py": ({}, lambda f, o: ["--trace", str(o / "train.py")], r"--trace .*train\.py would write over train\.py"),
    "save_weights_over_the_initial_weights": ({}, lambda f, o: ["--save-weights", str(o / "stages" / ".." / "weights")],
                                              r"--save-weights .*weights would write over weights/stage_0\.safetensors, "
                                              r"which autopart compile wrote in .*; give a path outside the compile's files"),
    "resume_without_checkpoint_dir": ({}, lambda f, o: ["--resume"], r"--resume needs --checkpoint-dir DIR"),
    "weights_lacking_a_parameter": ({}, _weights_lacking_one,
                                    r"lacks 1 tensor\(s\) of stage 0, first .*; save every parameter under its name"),
    "weights_not_safetensors": ({}, _not_safetensors, r"is not a safetensors file"),
    "weights_of_another_shape": ({}, _weights_of_another_shape,
                                 r"holds 'h\.0\.attn\.c_attn\.weight' at \(10, 64\), where the model compiled holds it "
                                 r"at \(192, 64\); give the weights of that model"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_torchrun_misuse(tmp_path, capsys, monkeypatch, compiled, case):
    """train.py as rank 0 of the plan's world, in this process: the checks that precede any peer."""
    environment, arguments, pattern = TRAIN_CASES[case]
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", **environment}.items():
        monkeypatch.setenv(name, value) if value is not None else monkeypatch.delenv(name, raising=False)
    argv = arguments(tmp_path, compiled)
    line = refused(capsys, lambda: train.main(compiled, argv), tmp_path, compiled)
    assert re.search(pattern, line), line


def test_stage_file_edited_after_the_compile(tmp_path, capsys, monkeypatch, compiled):
    import shutil

    out = shutil.copytree(compiled, tmp_path / "out")
    (out / "stages" / "stage_0.py").write_text((out / "stages" / "stage_0.py").read_text() + "\nimport os\n")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused(capsys, lambda: train.main(out, []), tmp_path)
    assert "stages/stage_0.py in" in line and "is not the file that autopart compile wrote" in line, line


def test_plan_edited_after_the_compile(tmp_path, capsys, monkeypatch, compiled):
    """The runtime reads the plan as the compile does, and its fix does not send a training run to --plan."""
    import shutil

    out = shutil.copytree(compiled, tmp_path / "out")
    (out / "plan.json").write_text(_edited_plan(compiled, lambda d: d["stages"][1].update(rank=5)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused(capsys, lambda: train.main(out, []), tmp_path)
    assert re.search(r"plan\.stages\[1\]\.rank is 5 .*; fix the field or recompile with autopart compile$", line), line


@pytest.mark.parametrize("edit, pattern", [
    (lambda out: (out / "stages" / "stage_1.py").unlink(), r"rank 1 needs stages/stage_1\.py of stage 1, which is missing"),
    (lambda out: (out / "model.py").write_text("# edited\n"), r"model\.py in .* is not the model file that was compiled"),
], ids=["stage_deleted", "model_copy_edited"])
def test_explain_says_that_train_py_would_refuse_an_output_edited_after_the_compile(tmp_path, capsys, compiled, edit,
                                                                                     pattern):
    """explain shows the plan of an edited output, as it was compiled, and says in one line that it no longer runs."""
    import shutil

    out = shutil.copytree(compiled, tmp_path / "out")
    edit(out)
    cli.main(["explain", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopart: warning: the figures below are the compile's; train.py "
                                                   "would refuse this folder: "), captured.err
    assert re.search(pattern, lines[0]), lines[0]
    assert "predicted step" in captured.out
    cli.main(["explain", str(compiled)])
    assert capsys.readouterr().err == "", "an output as compiled is explained without a word"


def _damaged(folder: Path) -> Path:
    (folder / "ckpt").mkdir()
    (folder / "ckpt" / "autopart.json").write_text(json.dumps({"step": 1, "files": {".metadata": "0" * 64}}))
    (folder / "ckpt" / ".metadata").write_bytes(b"")
    return folder / "ckpt"


def _crafted(folder: Path) -> Path:
    import pickle

    (folder / "ckpt").mkdir()
    metadata = pickle.PROTO + b"\x02" + pickle.GLOBAL + b"os\nsystem\n" + pickle.STOP
    (folder / "ckpt" / ".metadata").write_bytes(metadata)
    digest = hashlib.sha256(metadata).hexdigest()
    (folder / "ckpt" / "autopart.json").write_text(json.dumps({"step": 1, "files": {".metadata": digest}}))
    return folder / "ckpt"


def _damaged_steps(folder: Path) -> Path:
    for step in (1, 2):
        (folder / "ckpt" / f"step_0000000{step}").mkdir(parents=True)
        (folder / "ckpt" / f"step_0000000{step}" / "autopart.json").write_text(
            json.dumps({"step": step, "files": {".metadata": "0" * 64}}))
    return folder / "ckpt"


def _edited_copy(folder: Path, out: Path, edit) -> Path:
    import shutil

    copy = shutil.copytree(out, folder / "edited")
    edit(copy)
    return copy


COMMAND_CASES = {  # name -> (arguments given the test's folder and OUT, pattern of the one line)
    "consolidate_no_such_dir": (lambda f, o: ["consolidate", str(f / "nowhere"), "-o", str(f / "m.safetensors")],
                                r"checkpoint directory '.*nowhere' does not exist"),
    "consolidate_no_checkpoint": (lambda f, o: ["consolidate", str(f), "-o", str(f / "m.safetensors")],
                                  r"holds no complete checkpoint"),
    "consolidate_damaged": (lambda f, o: ["consolidate", str(_damaged(f)), "-o", str(f / "m.safetensors")],
                            r"checkpoint .*ckpt is damaged: \.metadata does not match its sha256"),
    "consolidate_crafted_metadata": (lambda f, o: ["consolidate", str(_crafted(f)), "-o", str(f / "m.safetensors")],
                                     r"checkpoint metadata names os\.system, which no checkpoint holds"),
    "consolidate_every_checkpoint_damaged": (  # 'holds no complete checkpoint; pass the --checkpoint-dir of a run'
        lambda f, o: ["consolidate", str(_damaged_steps(f)), "-o", str(f / "m.safetensors")],
        r"every checkpoint in '.*ckpt' is damaged \(2 checked; the newest, step_00000002: \.metadata is missing\); "
        r"restore the "
        r"folder from a copy$"),
    "consolidate_a_file": (lambda f, o: _a_file(f / "ckpt") + ["consolidate", str(f / "ckpt"), "-o", str(f / "m.st")],
                           r"checkpoint directory '.*ckpt' is a file; pass the --checkpoint-dir of a run$"),
    "consolidate_into_a_directory": (lambda f, o: ["consolidate", str(f), "-o", str(f)], r"is a directory; give a file path"),
    "verify_not_an_output": (lambda f, o: ["verify", str(f)], r"is not an autopart output directory \(no plan\.json\)"),
    "verify_a_stage_edited": (lambda f, o: ["verify", str(_edited_copy(f, o, lambda c: (c / "stages" / "stage_1.py").write_text(
                                  (c / "stages" / "stage_1.py").read_text() + "\nimport os\n")))],
                              r"stages/stage_1\.py in .*edited is not the file that autopart compile wrote"),
    "verify_a_stage_deleted": (lambda f, o: ["verify", str(_edited_copy(f, o, lambda c: (c / "stages" / "stage_0.py").unlink()))],
                               r"rank 0 needs stages/stage_0\.py of stage 0, which is missing from .*edited; recompile"),
    "verify_model_copy_edited": (lambda f, o: ["verify", str(_edited_copy(f, o, lambda c: (c / "model.py").write_text(
                                     (c / "model.py").read_text() + "\n# edited\n")))],
                                 r"model\.py in .*edited is not the model file that was compiled"),
    "verify_negative_lr": (lambda f, o: ["verify", str(o), "--lr", "-1"], r"--lr must be a finite learning rate, at least 0, got -1"),
    "verify_negative_timeout": (lambda f, o: ["verify", str(o), "--timeout", "-1"],
                                r"--timeout must be a positive number of seconds, got -1"),
    "verify_min_lr_above_lr": (lambda f, o: ["verify", str(o), "--lr-schedule", "linear", "--min-lr", "0.5"],
                               r"--min-lr 0\.5 is above --lr 0\.1, so --lr-schedule linear would raise the rate"),
    "verify_zero_steps": (lambda f, o: ["verify", str(o), "--steps", "0"], r"--steps must be at least 1, got 0"),
    "explain_trace_not_text": (lambda f, o: ["explain", str(o), "--trace", str(_binary(f / "t.json"))],
                               r"cannot read the trace .*t\.json: 'utf-8' codec can't decode .*; give a trace that "
                               r"OUT/train\.py --trace FILE wrote"),
    "explain_trace_nested_past_the_parser": (
        lambda f, o: ["explain", str(o), "--trace", str(_written(f / "t.json", "[" * 100000 + "]" * 100000))],
        r"cannot read the trace .*t\.json: maximum recursion depth exceeded.*; give a trace that OUT/train\.py"),
    "explain_not_an_output": (lambda f, o: ["explain", str(f)], r"plan\.json"),
    "profile_zero_batch": (lambda f, o: ["profile", "examples/gpt.py", "-o", str(f / "c.json"), "--micro-batch-size", "0"],
                           r"--micro-batch-size must be at least 1, got 0"),
    "profile_into_a_directory": (lambda f, o: ["profile", "examples/gpt.py", "-o", str(f)], r"is a directory; give the path of a \.json"),
    "profile_under_a_file": (lambda f, o: _a_file(f / "x") + ["profile", "examples/gpt.py", "-o", str(f / "x" / "c.json")],
                             r"-o .*c\.json lies under .*x, which is a file"),
    "profile_over_a_file_of_the_user_s": (lambda f, o: _a_file(f / "mine.py") + ["profile", "examples/gpt.py", "-o",
                                                                         str(f / "mine.py")],
                                          r"mine\.py is not a valid cost database .*; give one that 'autopart profile' "
                                          r"wrote, or a new path to write one at$"),
    "consolidate_under_a_file": (lambda f, o: _a_file(f / "x") + ["consolidate", str(f), "-o", str(f / "x" / "m.st")],
                                 r"-o .*m\.st lies under .*x, which is a file"),
    "compile_costs_under_a_file": (lambda f, o: _a_file(f / "x") + ["compile", "examples/gpt.py", "-o", str(f / "out"),
                                                                    "--costs", str(f / "x" / "c.json")],
                                   r"--costs .*c\.json lies under .*x, which is a file"),
    "unknown_command": (lambda f, o: ["compiel", "examples/gpt.py"], r"invalid choice: 'compiel'"),
}


@pytest.mark.parametrize("case", sorted(COMMAND_CASES))
def test_bad_command(tmp_path, capsys, compiled, case):
    arguments, pattern = COMMAND_CASES[case]
    argv = arguments(tmp_path, compiled)
    line = call_cli(capsys, *argv, watch=(tmp_path, compiled))
    assert re.search(pattern, line), line


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


def test_a_need_just_above_the_limit_prints_above_it():
    """The out-of-memory messages print the need rounded up, to as many figures as tell it from the limit."""
    gib = 1 << 30
    assert gib_beside(862951728, round(0.803 * gib)) == ("0.8037", "0.803")
    assert gib_beside(round(79.6481 * gib), round(79.6472 * gib)) == ("79.6481", "79.6472")
    assert gib_beside(335000000, round(0.0001 * gib)) == ("0.312", "0.0001")


def test_profile_comm_starts_no_more_processes_than_cores(capsys, monkeypatch):
    """Each gloo rank of profile-comm is a process of this machine: ``--ranks 100000`` (a typo of
    10) started them all, a fork bomb, where past one per core they measure the cores taking turns."""
    import cost_models.comm_profile as comm_profile
    from cost_models.calibration import usable_cores

    monkeypatch.setattr(comm_profile, "run_here", lambda *args, **kwargs: pytest.fail("profile-comm started its ranks"))
    ranks = max(2, usable_cores()) + 1
    line = call_cli(capsys, "profile-comm", "--ranks", str(ranks), "--backend", "gloo")
    assert re.search(rf"--ranks {ranks} would start {ranks} processes on this machine's \d+ cores?, .*; use --ranks "
                     rf"{ranks - 1} or fewer$", line), line


HUGE_BATCH = 10**12  # gpt's samples take 512 bytes each: 466 TiB, past any machine's memory


@pytest.mark.parametrize("how", ["cli", "cli_searched", "api"])
def test_a_global_batch_past_the_machine_s_memory_is_refused_before_it_is_built(tmp_path, how):
    """``--global-batch-size 1000000000`` hung: in counting up to it for the batch's divisors, then
    in an example batch of half a billion rows (the micro-batch), or under the search in a schedule
    of millions of microbatches. Every rank of train.py draws each global batch whole: one larger
    than this machine's memory is refused in one line, from the bytes of one example sample."""
    out = tmp_path / "out"
    gpt = REPO / "examples" / "gpt.py"
    if how == "api":
        code = ("import sys, autopart\n"
                f"try:\n    autopart.compile({str(gpt)!r}, global_batch_size={HUGE_BATCH})\n"
                "except autopart.AutopartError as error:\n"
                "    print(f'autopart: error: {error}', file=sys.stderr)\n    sys.exit(2)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                                env=environment(), cwd=REPO)  # fmt: skip
    else:
        searched = ["--world-size", "2"] if how == "cli_searched" else []
        result = run_cli("compile", str(gpt), "-o", str(out), "--global-batch-size", str(HUGE_BATCH), *searched,
                         timeout=90)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    ranks = "the 2 ranks here each draw" if how == "cli_searched" else "the rank here draws"
    assert re.fullmatch(rf"autopart: error: {ranks} every global batch \(1000000000000 samples\) whole: [\d,]+\.\d GiB "
                        r"of gpt\.py's samples \(512 bytes each\), more than this machine's [\d.]+ GiB of memory; give a "
                        r"smaller --global-batch-size\n", result.stderr), result.stderr
    assert not out.exists()


def test_a_global_batch_for_a_remote_cluster_is_bounded_by_what_the_compile_builds(tmp_path):
    """Compiled for a remote device, the ranks draw their batches on the cluster's nodes: this
    machine builds example batches of the micro-batch size only. A global batch larger than its
    memory compiles; a micro-batch larger is refused, and so are more microbatches a step than a
    schedule is laid out for (a million of them took minutes)."""
    import os

    sample = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 256  # 512 samples: twice the memory
    path = tmp_path / "volumes.py"
    path.write_text(GOOD_BATCH.replace("torch.randn(batch_size, 8)", f"torch.zeros(batch_size, {sample // 4})")
                    + "class Head(torch.nn.Linear):\n    def forward(self, x):\n        return super().forward(x[:, :8])\n"
                    + "def build_model():\n    return Head(8, 4)\n")  # fmt: skip
    gib = "--micro-batch-size"
    common = [str(path), "--device", "a100-80gb", "--no-measure"]
    result = run_cli("compile", *common, "-o", str(tmp_path / "out"), "--dp", "8", "--global-batch-size", "512",
                     "--micro-batch-size", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli("compile", *common, "-o", str(tmp_path / "big"), "--global-batch-size", "512", timeout=300)
    assert result.returncode == 2 and re.fullmatch(
        r"autopart: error: the compile builds example batches of the micro-batch size, 256 samples: .* more than this "
        rf"machine's [\d.]+ GiB of memory; give a smaller {gib}\n", result.stderr), result.stderr
    result = run_cli("compile", str(REPO / "examples" / "gpt.py"), "-o", str(tmp_path / "many"), "--device", "a100-80gb",
                     "--global-batch-size", str(1 << 20), "--micro-batch-size", "1", timeout=300)
    assert result.returncode == 2 and "1048576 microbatches a step per data-parallel replica is more than the 16384 a " \
        "schedule is laid out for; give a --micro-batch-size of at least 64\n" in result.stderr, result.stderr
    assert not (tmp_path / "big").exists() and not (tmp_path / "many").exists()
