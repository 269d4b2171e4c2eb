"""Model-state memory: the 16Ψ figures of ZeRO (SC20 §5) and the framework's own overhead."""

from __future__ import annotations

import pytest

from autopart.ir.errors import ConfigError
from cost_models import model_state_bytes
from autopart.predict.memory import state_bytes
from cost_models.memory import FRAMEWORK_OVERHEAD_BYTES, NCCL_BUFFER_BYTES, NCCL_CHANNELS, communicator_bytes

PARAMETERS = 1_000_003  # Ψ


@pytest.mark.parametrize("bytes_per_parameter,optimizer,master_weights,bytes_per_psi", [
    (4, "adamw", False, 16),  # fp32: weights 4, grads 4, two fp32 moments 8
    (2, "adamw", True, 16),  # mixed: bf16 weights 2, grads 2, fp32 master 4 + moments 8
    (4, "adam", False, 16),
    (4, "sgd", False, 8),  # weights and grads, nothing else
    (2, "sgd", True, 8),  # 2 + 2 + fp32 master 4
    (4, "sgd_momentum", False, 12),
    (2, "adamw", False, 8),  # pure bf16 with moments in bf16, as torch.optim keeps them
])
def test_model_state_bytes(bytes_per_parameter: int, optimizer: str, master_weights: bool,
                           bytes_per_psi: int) -> None:
    assert model_state_bytes(PARAMETERS * bytes_per_parameter, optimizer=optimizer,
                             master_weights=master_weights) == PARAMETERS * bytes_per_psi


def test_unknown_optimizer_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'; use one of sgd, .*adamw"):
        model_state_bytes(4, optimizer="lion")


@pytest.mark.parametrize("optimizer, states", [("adamw", 2), ("sgd", 0)])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_zero_1_shares_only_the_optimizer_state(optimizer: str, states: int, dp: int) -> None:
    """ZeRO stage 1 (SC20 §5): weights and gradients whole on every rank, the optimizer state
    (here fp32: ``states`` tensors of 4Ψ) a d-th each; 4Ψ + 12Ψ/d in the paper's mixed precision."""
    fp32 = 4 * PARAMETERS
    assert state_bytes(fp32, optimizer=optimizer, dp=dp, zero=True) == 2 * fp32 + states * fp32 // dp
    assert state_bytes(fp32, optimizer=optimizer, dp=dp, zero=False) == (2 + states) * fp32
    mixed = model_state_bytes(2 * PARAMETERS, optimizer="adamw", master_weights=True)
    assert mixed - 4 * PARAMETERS == 12 * PARAMETERS  # the part that ZeRO-1 shares out: 12Ψ


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("dp", [2, 8])
def test_fsdp_levels_hold_whole_weights_and_gradients_at_the_peak_beside_every_shard(zero: int, dp: int) -> None:
    """With a stage (level 2) or its root (level 3: outside the repeated layers) as the FSDP unit,
    the peak holds the gathered parameters and the gradients autograd writes before their
    reduce-scatter (2P), and a d-th of parameters, gradients and AdamW's state (16Ψ/d in fp32):
    neither is below ZeRO-1 (a layer's own unit is, `tests/test_memory_zero3.py`)."""
    fp32 = 4 * PARAMETERS
    assert state_bytes(fp32, optimizer="adamw", dp=dp, zero=zero) == 2 * fp32 + 4 * fp32 // dp
    assert state_bytes(fp32, optimizer="adamw", dp=dp, zero=zero) > state_bytes(fp32, optimizer="adamw", dp=dp, zero=1)
    assert state_bytes(fp32, optimizer="adamw", dp=1, zero=zero) == 4 * fp32  # one replica: nothing to shard


def test_the_cpu_framework_overhead_covers_a_process_with_torch_imported() -> None:
    """The figure for a CPU process stands for Python with torch imported, measured here in a
    fresh process: it must cover that and not be wildly above it."""
    import subprocess
    import sys

    # VmHWM, not ru_maxrss: Linux carries a forked child's maximum over from its parent through exec,
    # so under a large pytest process ru_maxrss reads the parent's size
    code = ("import torch; print(next(int(line.split()[1]) for line in open('/proc/self/status') "
            "if line.startswith('VmHWM:')))")
    resident = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) << 10
    assert resident <= FRAMEWORK_OVERHEAD_BYTES["cpu"] < 3 * resident


@pytest.mark.parametrize(
    "kind,pp,tp,dp,schedule,peers",
    [
        ("cuda", 1, 1, 1, "1f1b", 0),  # one rank: NCCL connects to nobody
        ("cuda", 1, 1, 2, "1f1b", 2),  # dp 2: the world's group and the dp group, one peer each
        ("cuda", 1, 8, 1, "1f1b", 4),  # tp 8: two rings, two peers each
        ("cuda", 4, 1, 1, "1f1b", 6),  # pp 4: the world's ring, and to each of two neighbours activations one way,
        ("cuda", 4, 1, 1, "zb-h1", 6),  # gradients the other: a communicator per kind, direction and pair
        ("cuda", 4, 1, 1, "zbv", 10),  # ZB-V's messages turn back at the bottom of the V: both ways to each
        ("cuda", 2, 1, 1, "interleaved", 5),  # two ranks interleaved send each other both ways
        ("cuda", 4, 1, 1, "interleaved", 6),  # four: one way to the next rank round the ring
        ("cpu", 4, 2, 2, "zbv", 0),  # gloo's buffers are the process's own memory
    ],
)
def test_nccl_buffers_per_peer_and_channel(kind: str, pp: int, tp: int, dp: int, schedule: str, peers: int) -> None:
    assert NCCL_BUFFER_BYTES == 4 << 20  # NCCL_BUFFSIZE's default
    assert communicator_bytes(kind, pp=pp, tp=tp, dp=dp, schedule=schedule) == peers * NCCL_CHANNELS * NCCL_BUFFER_BYTES


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "interleaved"])
@pytest.mark.parametrize("pp", [2, 4])
def test_the_pipeline_channels_counted_are_those_the_runtime_opens(schedule: str, pp: int) -> None:
    """The busiest rank's pipeline communicators are those `Channels.connections` opens for the
    generated action lists: a channel of a kind and direction between a pair of ranks."""
    from autopart.ir.actions import Kind
    from autopart.runtime.p2p import Channels
    from autopart.schedule import add_communication, build_schedule, stage_placement
    from cost_models.memory import pipeline_channels

    chunks = 2 if schedule in ("zbv", "interleaved") else 1
    placement = stage_placement(schedule, ranks=pp, chunks=chunks)
    lists = add_communication(build_schedule(schedule, ranks=pp, microbatches=2 * pp, chunks=chunks), ranks=pp,
                              placement=placement)
    opened = []
    for rank, actions in lists.items():
        earlier = (Kind.RECV_F, Kind.SEND_B)  # from or to the stage before; the others the stage after
        messages = {(a.kind, placement[a.stage - 1 if a.kind in earlier else a.stage + 1])
                    for a in actions if not a.is_compute}
        opened.append(len(Channels.connections(messages, rank)))
    assert max(opened) == pipeline_channels(schedule, pp)


def test_a_gpu_plan_predicts_the_nccl_buffers_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopart.driver import compile
    from cost_models import memory
    from tests.distributed import REPO

    def predicted(channels: int) -> tuple[int, ...]:
        monkeypatch.setattr(memory, "NCCL_CHANNELS", channels)
        plan = compile(REPO / "examples" / "gpt.py", pp=2, microbatches=2, device="h200", time_limit_s=5)
        return plan.predicted.memory_bytes

    with_buffers, without = predicted(16), predicted(0)
    peers = 3  # the world's group of two ranks, and the neighbour's activations and gradients channels
    assert [a - b for a, b in zip(with_buffers, without)] == [peers * 16 * NCCL_BUFFER_BYTES] * 2


def test_the_loss_backward_s_working_set_is_counted_on_the_last_stage_s_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cross-entropy's backward holds the gradients of its log-probabilities and its logits in
    fp32 besides what the forward saved: 8 bytes a logit, on the rank of the last stage alone."""
    from autopart.driver import compile
    from autopart.options import CompileOptions
    from autopart.passes import front as front_pass
    from autopart.solve import assemble
    from tests.distributed import FREE_LINKS, REPO

    gpt = REPO / "examples" / "gpt.py"  # micro-batch 2 of 32 tokens, 512 words
    front = front_pass.build_front(CompileOptions(model=gpt, pp=1, tp=1, micro_batch_size=2, device="h100-sxm",
                                                  dtype="bf16", measure=False), 2)
    assert front_pass.loss_working_bytes(front, 1) == 2 * 4 * (2 * 32) * 512
    split = front_pass.build_front(CompileOptions(model=gpt, pp=1, tp=2, micro_batch_size=2, device=str(FREE_LINKS),
                                                  measure=False), 2)
    assert front_pass.loss_working_bytes(split, 2) == 4 * (2 * 32) * 512, "the vocabulary split: each rank half"

    def predicted(counted: bool) -> tuple[int, ...]:
        if not counted:
            monkeypatch.setattr(assemble, "loss_working_bytes", lambda front, tp: 0)
        plan = compile(gpt, pp=2, microbatches=2, micro_batch_size=2, device="h100-sxm", time_limit_s=5)
        return plan.predicted.memory_bytes

    with_loss, without = predicted(True), predicted(False)
    assert [a - b for a, b in zip(with_loss, without)] == [0, 2 * 4 * (2 * 32) * 512]
