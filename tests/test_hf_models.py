"""Hugging Face transformers 5.x models (tiny random configs, wrapped to return the logits) are
captured with torch.export and train through autopart like the original model."""

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from tests.distributed import REPO
from tests.distributed import assert_same_training, compile_and_train
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
