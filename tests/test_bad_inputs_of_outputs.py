"""A catalogue of bad inputs, second of two: device TOMLs, output directories, plans, weights,
checkpoints, torchrun misuse and the commands that read an output directory (the first,
tests/test_bad_inputs.py: model files and the compile's options). Each ends as one line naming the
problem and what to do, exit code 2, no traceback, and nothing half-written or deleted."""

import json
import re
import hashlib
from pathlib import Path

import pytest

from autopart.tools import cli
from autopart.runtime import train
from cost_models.devices import DEVICES_DIR
from tests.distributed import REPO
from tests.refusals import assert_nothing_written, call_cli, refused

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
    "corrupt_marker": (lambda out: (out.mkdir(), (out / "plan.json").write_text("{}"),
                                    (out / ".autopart-output.json").write_text('{"files": ["plan.js')),
                       r"holds a \.autopart-output\.json that cannot be read \(JSONDecodeError: Unterminated string .*\), so "
                       r"which of its files autopart wrote is unknown; choose a new or empty directory for -o"),
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
    assert re.search(r"plan\.json was compiled from gpt\.py, not from llama\.py; give gpt\.py with this --plan, or "
                     r"recompile without --plan$", line), line  # not 'from another version of llama.py'
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_plan_of_another_version_of_the_model(tmp_path, capsys, compiled):
    model = tmp_path / "gpt.py"
    model.write_text((REPO / "examples" / "gpt.py").read_text() + "\n# edited\n")
    line = call_cli(capsys, "compile", str(model), "-o", str(tmp_path / "out"), "--plan", str(compiled / "plan.json"),
                    watch=(tmp_path, compiled))
    assert re.search(r"plan\.json was compiled from another version of gpt\.py .*; recompile without --plan$", line), line


@pytest.mark.parametrize("pins, pattern", [
    (["--pp", "4"], r"--pp 4 contradicts plan\.json, which --plan emits as it is \(pp 2\); drop --pp, or recompile without --plan"),
    (["--microbatches", "4"], r"--microbatches 4 contradicts plan\.json, .*\(microbatches 2\)"),
    (["--dtype", "bf16"], r"--dtype bf16 contradicts plan\.json, .*\(dtype fp32\)"),
    (["--world-size", "8", "--global-batch-size", "64"], r"--world-size 8 contradicts plan\.json, .*\(world_size 2\)"),
    (["--sp"], r"--sp splits what tensor parallelism computes, and this compile has none \(tensor parallelism 1\)"),
    (["--tp-overlap"], r"--tp-overlap splits what tensor parallelism computes, and this compile has none"),
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
        path.parent.mkdir(parents=True)
    path.write_text("mine")
    return []


def _weights_of_a_plan(folder: Path, digest: str) -> list[str]:
    """Stage 0's weights as train.py --save-weights writes them, for the plan of ``digest``."""
    import torch
    from safetensors.torch import save_file

    from autopart.runtime.launch import PLAN_HASH_KEY

    folder.mkdir()
    save_file({"w": torch.ones(2)}, str(folder / "stage_0.safetensors"), metadata={PLAN_HASH_KEY: digest})
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
    "save_weights_over_the_user_s_file": ({}, lambda f, o: _a_file(f / "w" / "stage_0.safetensors", folder=True)
                                          + ["--save-weights", str(f / "w")],
                                          r"--save-weights .*w holds stage_0\.safetensors, which names no plan \(not "
                                          r"autopart's, or saved by an older autopart\); give another folder, or delete "
                                          r"the file first$"),
    "save_weights_over_another_compile_s": ({}, lambda f, o: _weights_of_a_plan(f / "w", "0" * 64)
                                            + ["--save-weights", str(f / "w")],
                                            r"--save-weights .*w holds stage_0\.safetensors, another compile's weights "
                                            r"\(plan sha256 000000000000, this one's [0-9a-f]{12}\); give another "
                                            r"folder, or delete them first$"),
    "trace_over_the_user_s_file": ({}, lambda f, o: _a_file(f / "model.py") + ["--trace", str(f / "model.py")],
                                   r"--trace .*model\.py exists and is not a Chrome trace that train\.py wrote; give a new "
                                   r"path, or move the file away first"),
    "metrics_appended_to_the_user_s_file": ({}, lambda f, o: _a_file(f / "notes.txt") + ["--metrics", str(f / "notes.txt")],
                                            r"--metrics .*notes\.txt exists and is not JSON lines of steps that train\.py "
                                            r"wrote"),
    "action_times_appended_to_the_user_s_file": (  # appended to in silence, where --metrics refused such a file
        {}, lambda f, o: _a_file(f / "t" / "rank_0.jsonl", folder=True) + ["--action-times", str(f / "t")],
        r"--action-times .*t/rank_0\.jsonl exists and is not JSON lines of steps that train\.py wrote; give a new path"),
    "metrics_appended_to_the_plan": ({}, lambda f, o: ["--metrics", str(o / "plan.json")],
                                     r"--metrics .*plan\.json would write over plan\.json, which autopart compile wrote in "),
    "trace_over_train_py": ({}, lambda f, o: ["--trace", str(o / "train.py")], r"--trace .*train\.py would write over train\.py"),
    "save_weights_over_the_initial_weights": ({}, lambda f, o: ["--save-weights", str(o / "stages" / ".." / "weights")],
                                              r"--save-weights .*weights would write over weights/stage_0\.safetensors, "
                                              r"which autopart compile wrote in .*; give a path outside the compile's files"),
    "checkpoint_dir_holding_a_step_of_the_user_s": (  # it was 'damaged', and 'restore the folder from a copy'
        {}, lambda f, o: _a_file(f / "c" / "step_00000001" / "notes.txt", folder=True) + ["--checkpoint-dir", str(f / "c"),
                                                                                         "--resume"],
        r"--checkpoint-dir .*c holds step_00000001, which autopart did not save \(it holds no autopart\.json and none "
        r"of a checkpoint's files\); move it out of .*c, or give another --checkpoint-dir$"),
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
    "consolidate_a_folder_of_the_user_s": (  # 'every checkpoint is damaged; restore the folder from a copy'
        lambda f, o: _a_file(f / "c" / "step_00000001" / "notes.txt", folder=True) + ["consolidate", str(f / "c"), "-o",
                                                                                     str(f / "m.safetensors")],
        r"'.*c' holds no checkpoint \(step_00000001 holds no autopart\.json and none of a checkpoint's files\); pass the "
        r"--checkpoint-dir of a run$"),
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
    "profile_over_a_plan": (lambda f, o: ["profile", "examples/gpt.py", "-o", str(o / "plan.json")],  # 'has schema None'
                            r"cost database .*plan\.json is not one but a plan that autopart compile wrote; give one "
                            r"that 'autopart profile' wrote, or a new path to write one at$"),
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
