"""The whole-plan search through the compiler: pins, the plan it writes, and models that do not fit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ConfigError, InfeasibleError
from autopart.solve.planner import plan_by_search
from autopart.solve.search import SearchSpace
from cost_models.memory import communicator_bytes
from tests.distributed import run_cli_here

REPO = Path(__file__).resolve().parent.parent
GPT = REPO / "examples" / "gpt.py"
LONG_GPT = REPO / "tests" / "models" / "long_gpt.py"


@pytest.fixture(scope="module")
def searched():
    """GPT on 2 H100s (roofline costs: the same figures on every machine), batch 4."""
    return plan_by_search(CompileOptions(model=GPT, world_size=2, global_batch_size=4, device="h100-sxm"))


def test_the_chosen_plan_is_the_fastest_finalist_and_fits(searched) -> None:
    plan = searched.plan
    assert plan.world_size == 2
    assert plan.schedule.microbatches * plan.schedule.micro_batch_size * plan.mesh["dp"] == 4
    ranked = plan.provenance.search["ranked"]
    steps = [entry["step_s"] for entry in ranked]
    assert steps == sorted(steps) and len(steps) > 1
    assert steps[0] == pytest.approx(plan.predicted.step_s)
    assert plan.predicted.step_s <= min(p.predicted.step_s for p in (f.plan for f in searched.finalists)) * (1 + 1e-9)
    # each pipeline rank holds at least the H100 process's 500 MiB and, for fp32 AdamW, 16 bytes per
    # parameter of its stages over tp (weights, gradients, two moments; the moments over dp with
    # ZeRO-1: SC20 §5), and activations on top
    assert plan.optimizer == "adamw"
    moments_over = plan.mesh["dp"] if plan.zero else 1
    for rank, predicted in enumerate(plan.predicted.memory_bytes):
        held = sum(s.parameter_bytes for s in plan.stages if s.rank == rank) // plan.mesh["tp"]  # 4 bytes each
        assert predicted > 500 * 2**20 + 2 * held + 2 * held // moments_over, rank
    assert searched.result.scored <= searched.result.layouts
    assert plan.provenance.solver_status in ("optimal", "feasible", "bisection", "trivial")
    assert 0.0 <= plan.provenance.gap <= 1.0 and plan.provenance.bound_s <= plan.provenance.objective_s * (1 + 1e-9)


def test_every_node_is_in_exactly_one_stage(searched) -> None:
    nodes = [n for stage in searched.plan.stages for n in stage.nodes]
    assert len(nodes) == len(set(nodes))
    compute = {b for block in searched.front.chain.blocks for b in block.nodes}
    assert set(nodes) == compute


def test_pins_are_kept_and_the_rest_is_searched() -> None:
    searched = plan_by_search(CompileOptions(model=GPT, world_size=4, global_batch_size=8, device="h100-sxm", pp=2,
                                             schedule="gpipe", micro_batch_size=2))
    assert searched.plan.mesh["pp"] == 2 and searched.plan.mesh["tp"] * searched.plan.mesh["dp"] == 2
    assert {entry["layout"].split()[0] for entry in searched.plan.provenance.search["ranked"]} == {"pp2"}
    assert all("x2 gpipe" in entry["layout"]
               for entry in searched.plan.provenance.search["ranked"])


def test_a_searched_plan_pinned_again_is_predicted_the_same(searched, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    searched.plan.save(path)
    again, _ = compile_to_directory(CompileOptions(model=GPT, device="h100-sxm", plan=path), tmp_path / "out")
    assert again.predicted.step_s == pytest.approx(searched.plan.predicted.step_s, rel=1e-9)
    assert again.predicted.memory_bytes == searched.plan.predicted.memory_bytes


def test_a_pinned_zero_level_rules_out_the_layouts_without_data_parallelism() -> None:
    """A layout of dp 1 has nothing to shard: it took ZeRO 0 whatever --zero pinned, so the pin was dropped without
    a word where the search chose one (--world-size 2 --zero 1 gave pp 2, ZeRO 0)."""
    space = SearchSpace(world_size=4, global_batch_size=8, zero=(1,))
    layouts = list(space.layouts(blocks=8))
    assert layouts and all(layout.dp > 1 and layout.zero == 1 for layout in layouts)
    assert any(layout.dp == 1 for layout in SearchSpace(world_size=4, global_batch_size=8).layouts(blocks=8))
    with pytest.raises(ConfigError, match=r"no layout of 1 devices .*\(and be 2 or more with --zero\)"):
        plan_by_search(CompileOptions(model=GPT, world_size=1, global_batch_size=4, device="h100-sxm", zero=1))


@pytest.mark.parametrize("pins", [{"schedule": ("zbv",)}, {"schedule": ("interleaved",)}, {"chunks": (2,)}])
def test_a_single_stage_layout_keeps_the_chunks_its_pins_need(pins) -> None:
    """One stage took 1 chunk whatever was pinned: zbv's estimate then read a second stage that was not there
    (IndexError), interleaved was refused for its 1 chunk, and --chunks 2 was dropped without a word."""
    layouts = list(SearchSpace(world_size=2, global_batch_size=8, **pins).layouts(blocks=8))
    assert any(layout.pp == 1 for layout in layouts)
    assert all(layout.chunks == 2 for layout in layouts if layout.schedule == "zbv" or "chunks" in pins)
    assert all(layout.chunks > 1 for layout in layouts if layout.schedule == "interleaved")
    assert all(layout.schedule == pins["schedule"][0] for layout in layouts) if "schedule" in pins else True


def test_the_search_needs_the_global_batch() -> None:
    with pytest.raises(ConfigError, match="--global-batch-size"):
        plan_by_search(CompileOptions(model=GPT, world_size=2, device="h100-sxm"))


def test_impossible_pins_say_which(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--pp 3 does not divide --world-size 4: pp x tp x dp must equal the world "
                                          r"size; change a pin or --world-size$"):
        plan_by_search(CompileOptions(model=GPT, world_size=4, global_batch_size=8, device="h100-sxm", pp=3))


def _named_memory(message: str) -> float:
    """The GiB per device that a does-not-fit message tells to use (``--memory X``)."""
    return float(message.split("--memory ")[1].split()[0])


def test_a_model_that_cannot_fit_names_the_memory_that_would(tmp_path: Path) -> None:
    # An H100 process takes 500 MiB before the model, and NCCL's buffers 128 MiB more on every
    # layout of two ranks (two connected peers; a pipeline's two channels, 192): at 0.47 GiB nothing fits.
    nccl_gib = communicator_bytes("cuda", pp=1, tp=1, dp=2) / 2**30
    assert communicator_bytes("cuda", pp=1, tp=2, dp=1) / 2**30 == nccl_gib
    assert communicator_bytes("cuda", pp=2, tp=1, dp=1) / 2**30 == 1.5 * nccl_gib
    out = tmp_path / "out"
    result = run_cli_here("compile", str(GPT), "-o", str(out), "--world-size", "2", "--global-batch-size", "4",
                          "--device", "h100-sxm", "--memory", "0.47")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopart: error: the model does not fit on 2 devices")
    needed = _named_memory(lines[0])
    assert 0.47 + nccl_gib < needed < 0.6 + nccl_gib
    assert not out.exists()
    # and the memory it names is enough
    fits = run_cli_here("compile", str(GPT), "-o", str(out), "--world-size", "2", "--global-batch-size", "4",
                        "--device", "h100-sxm", "--memory", str(needed))
    assert fits.returncode == 0, fits.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert max(plan["predicted"]["memory_bytes"]) <= needed * (1 << 30)
    assert "the chosen plan first" in fits.stdout and "runners-up" not in fits.stderr
    # and it is the least: named to 4 figures from a bisection to 64 KiB, so 0.0002 GiB less fits no layout
    with pytest.raises(InfeasibleError):
        compile_to_directory(CompileOptions(model=GPT, world_size=2, global_batch_size=4, device="h100-sxm",
                                            memory_gib=needed - 0.0002), tmp_path / "less")


def _leanest_gib(options: CompileOptions, tmp_path: Path) -> float:
    """The memory per device that the does-not-fit error names for ``options``."""
    with pytest.raises(InfeasibleError) as error:
        compile_to_directory(replace(options, memory_gib=0.1), tmp_path / "too-small")
    return _named_memory(str(error.value))


@pytest.mark.multiprocess
def test_a_searched_plan_with_interleaving_and_recompute_trains_like_one_process(tmp_path: Path) -> None:
    """World size 4 on this CPU: the search, given the schedule kind and a memory limit that no
    plan without recompute meets (half-way between the leanest plan without it and the leanest
    with full recompute, as the does-not-fit error names them), picks the chunks, the cuts and
    the recompute of each stage; the programs train like one process."""
    from tests.distributed import Trained, assert_same_training, read_metrics, run_ranks, stage_weights

    pinned = CompileOptions(model=LONG_GPT, world_size=4, global_batch_size=16, microbatches=8, dp=2, tp=1,
                            schedule="interleaved", device="h100-sxm", optimizer="sgd")
    without = _leanest_gib(replace(pinned, recompute="none"), tmp_path)
    with_full = _leanest_gib(replace(pinned, recompute="full"), tmp_path)
    limit = (without + with_full) / 2  # long sequences: recompute frees megabytes here
    with pytest.raises(InfeasibleError):  # the premise: without recompute, nothing fits
        compile_to_directory(replace(pinned, recompute="none", memory_gib=limit), tmp_path / "without")
    out = tmp_path / "out"
    plan, _ = compile_to_directory(replace(pinned, memory_gib=limit), out)
    assert plan.mesh == {"pp": 2, "tp": 1, "dp": 2} and plan.schedule.chunks >= 2
    assert any(stage.recompute != "none" for stage in plan.stages)
    assert max(plan.predicted.memory_bytes) <= limit * (1 << 30)
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, plan.world_size, "--steps", "2", "--lr", "0.1", "--optimizer", "sgd", "--metrics", str(metrics),
              "--save-weights", str(tmp_path / "final"))
    run = Trained(plan=plan, out=out, metrics=read_metrics(metrics), finals=stage_weights(tmp_path / "final"),
                  steps=2, trace=None)
    assert_same_training(run, optimizer="sgd", lr=0.1)


def test_dtype_auto_chooses_bf16_where_tensor_cores_pay(tmp_path: Path) -> None:
    """A GPT of width 1024 at sequence 1024 on H100s: bf16 runs at the 16-bit rate, and the search
    asked to choose the dtype takes it; the fp32 plan it passed over is slower."""
    model = tmp_path / "gpt_wide.py"
    model.write_text(
        "import sys\nimport torch\n"
        f"sys.path.insert(0, {str(REPO / 'examples')!r})\n"
        "import gpt\n"
        "CONFIG = gpt.GPTConfig(vocab_size=2048, block_size=1024, n_layer=2, n_head=16, n_embd=1024)\n"
        "def build_model():\n    with torch.device('meta'):\n        return gpt.GPT(CONFIG)\n"
        "def init_weights(module):\n    pass\n"
        "def example_batch(batch_size):\n"
        "    tokens = torch.zeros(batch_size, CONFIG.block_size + 1, dtype=torch.long)\n"
        "    return (tokens[:, :-1],), tokens[:, 1:]\n"
        "loss_fn = gpt.loss_fn\n"
    )
    common = dict(model=model, world_size=2, global_batch_size=4, micro_batch_size=2, tp=1, device="h100-sxm")
    auto = plan_by_search(CompileOptions(dtype="auto", **common)).plan
    fp32 = plan_by_search(CompileOptions(dtype="fp32", **common)).plan
    assert auto.dtype == "bf16" and fp32.dtype == "fp32"
    assert auto.predicted.step_s < 0.5 * fp32.predicted.step_s


def test_the_search_keeps_each_replica_within_the_microbatches_a_schedule_is_laid_out_for(monkeypatch) -> None:
    """A replica runs at most MOST_MICROBATCHES a step (here lowered to 8): a pinned micro-batch
    size takes the layouts whose share it splits within them (dp 2 here; it chose dp 1 and was
    refused mid-search), an unpinned one grows past MAX_MICRO_BATCH_SIZE where the share needs
    it (the search found no layout), and a refusal names a size that divides the share."""
    import autopart.options
    import autopart.solve.search

    for module in (autopart.options, autopart.solve.search):
        monkeypatch.setattr(module, "MOST_MICROBATCHES", 8)
    space = SearchSpace(world_size=2, global_batch_size=64, micro_batch_size=(4,))
    assert {(layout.dp, layout.microbatches) for layout in space.layouts(8)} == {(2, 8)}
    space = SearchSpace(world_size=1, global_batch_size=1024)
    assert {layout.micro_batch_size for layout in space.layouts(8)} == {128}
    with pytest.raises(ConfigError, match=r"^45 microbatches a step per data-parallel replica is more than the 8 a "
                                          r"schedule is laid out for; give a --micro-batch-size of at least 9$"):
        CompileOptions(model=GPT, global_batch_size=45, micro_batch_size=1).batch_shape()
