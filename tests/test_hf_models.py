"""Hugging Face transformers 5.x models (tiny random configs, wrapped to return the logits) are
captured with torch.export and train through autopart like the original model."""

import runpy

import pytest
import torch
from safetensors.torch import save_file

from autopart.driver import CompileOptions, compile_to_directory
from tests.distributed import REPO
from tests.distributed import Trained, assert_same_training, compile_and_train, read_metrics, run_ranks, stage_weights
from tests.test_tp_families import model_file

pytest.importorskip("transformers", minversion="5")

MODELS = REPO / "tests" / "models"


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["hf_gpt2", "hf_llama"])
def test_hf_model_trains_like_one_process(tmp_path, model):
    run = compile_and_train(tmp_path, MODELS / f"{model}.py", pp=2, microbatches=2, schedule="1f1b")
    assert run.plan.provenance.capture == "export"
    assert len(run.plan.stages) == 2
    assert_same_training(run, optimizer="sgd", lr=0.1)


@pytest.mark.multiprocess
def test_hf_mixtral_experts_train_like_one_process(tmp_path):
    """Mixtral's experts run a custom op of transformers' (``torch.ops.transformers.grouped_mm_fallback``),
    which a rank has only once it imports the module defining it, and which importing the model
    file does not import: each stage file imports it, where every rank failed on its first forward."""
    model = model_file(tmp_path, "hf_mixtral", vocab=128, width=32, heads=4, kv_heads=2)
    run = compile_and_train(tmp_path, model, pp=2, microbatches=2, schedule="1f1b")
    assert "import transformers.integrations.moe" in (run.out / "stages" / "stage_0.py").read_text()
    assert_same_training(run, optimizer="sgd", lr=0.1)


@pytest.mark.multiprocess
def test_weights_that_hold_a_tied_head_under_its_embeddings_name_alone_train_like_one_process(tmp_path):
    """Hugging Face's ``save_pretrained`` keeps a tied tensor under one of its names: ``--weights``
    reads a tied tensor under any name the model holds it by, where it refused a file without the
    name the plan gives it (GPT-2's head, ``lm_head.weight``, under torch.export)."""
    plan, out = compile_to_directory(CompileOptions(model=MODELS / "hf_gpt2.py", pp=2, microbatches=2,
                                                    micro_batch_size=2), tmp_path / "out")  # fmt: skip
    (held, stages), = plan.tied_parameters.items()
    assert held == "gpt2.lm_head.weight" and stages == (0, 1)
    state = runpy.run_path(str(MODELS / "hf_gpt2.py"))["build_model"]().state_dict()
    weights = tmp_path / "pretrained.safetensors"
    save_file({name: value + 0.01 for name, value in state.items() if name != held}, str(weights))
    run_ranks(out, 2, "--steps", "2", "--lr", "0.1", "--optimizer", "sgd", "--weights", str(weights),
              "--metrics", str(tmp_path / "m.jsonl"), "--save-weights", str(tmp_path / "final"))  # fmt: skip
    run = Trained(plan=plan, out=out, metrics=read_metrics(tmp_path / "m.jsonl"),
                  finals=stage_weights(tmp_path / "final"), steps=2, trace=None)  # fmt: skip
    assert_same_training(run, optimizer="sgd", lr=0.1, weights=weights)
    torch.testing.assert_close(run.finals[0][held][:2], run.finals[1][held][:2])


def test_hf_bert_compiles_with_its_attention_mask_on_every_stage(tmp_path):
    # (its training matches one process too; that run is left out of the suite to keep it short)
    plan, out = compile_to_directory(
        CompileOptions(model=MODELS / "hf_bert.py", pp=2, microbatches=2, micro_batch_size=2), tmp_path / "out"
    )
    assert plan.provenance.capture == "export"
    assert plan.graph_inputs == ("tokens", "attention_mask", "target")
    # the mask is batch-derived: each stage rebuilds it from the batch instead of receiving it
    assert all("attention_mask" in s.batch_inputs for s in plan.stages)
    assert all(name not in ("attention_mask",) for s in plan.stages for name, _ in s.inputs)


@pytest.mark.multiprocess
def test_a_gpu_bf16_plan_that_cpu_autocast_refuses_says_why_and_what_to_do(tmp_path):
    """GPT-2's plan for an H100 in bf16 meets CPU autocast's refusal of a bf16 norm weight beside
    fp32 values (CUDA's runs norms in fp32): the rank's line says so and how to run it here,
    where it ended on torch's 'mixed dtype (CPU)'."""
    from autopart.tools.verify import verify
    from autopart.tools.local_run import LocalRunError

    compile_to_directory(CompileOptions(model=MODELS / "hf_gpt2.py", global_batch_size=2, device="h100-sxm",
                                        dtype="bf16", measure=False), tmp_path / "out")  # fmt: skip
    with pytest.raises(LocalRunError, match=r"mixed dtype \(CPU\).*a bf16 plan compiled for a GPU runs there, or "
                                            r"compile with --device cpu"):
        verify(tmp_path / "out", steps=1)
