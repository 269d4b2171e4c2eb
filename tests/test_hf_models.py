"""Hugging Face transformers 5.x models (tiny random configs, wrapped to return the logits) are
captured with torch.export and train through autopart like the original model."""

import pytest

from tests.distributed import REPO
from tests.test_pipeline_equivalence import assert_same_training, compile_and_train

pytest.importorskip("transformers", minversion="5")

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("model", ["hf_gpt2", "hf_llama", "hf_bert"])
def test_hf_model_trains_like_one_process(tmp_path, model):
    plan, out, metrics, finals = compile_and_train(
        tmp_path, REPO / "tests" / "models" / f"{model}.py", pp=2, microbatches=2, schedule="1f1b"
    )
    assert plan.provenance.capture == "export"
    assert len(plan.stages) == 2
    assert_same_training(plan, out, metrics, finals, optimizer="sgd", lr=0.1)
