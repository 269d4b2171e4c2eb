"""Model-state memory: the 16Ψ figures of ZeRO (SC20 §5) and the framework's own overhead."""

from __future__ import annotations

import pytest

from autopart.errors import ConfigError
from cost_models import model_state_bytes
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


def test_framework_overhead_by_device_kind() -> None:
    assert FRAMEWORK_OVERHEAD_BYTES["cuda"] == 500 * 2**20
    assert 0 < FRAMEWORK_OVERHEAD_BYTES["cpu"] < FRAMEWORK_OVERHEAD_BYTES["cuda"]


@pytest.mark.parametrize(
    "kind,pp,tp,dp,peers",
    [
        ("cuda", 1, 1, 1, 0),  # one rank: NCCL connects to nobody
        ("cuda", 1, 1, 2, 2),  # dp 2: the world's group and the dp group, one peer each
        ("cuda", 1, 8, 1, 4),  # tp 8: two rings, two peers each
        ("cuda", 4, 1, 1, 4),  # pp 4: the world's ring and two pipeline neighbours
        ("cpu", 4, 2, 2, 0),  # gloo's buffers are the process's own memory
    ],
)
def test_nccl_buffers_per_peer_and_channel(kind: str, pp: int, tp: int, dp: int, peers: int) -> None:
    assert NCCL_BUFFER_BYTES == 4 << 20  # NCCL_BUFFSIZE's default
    assert communicator_bytes(kind, pp=pp, tp=tp, dp=dp) == peers * NCCL_CHANNELS * NCCL_BUFFER_BYTES


def test_a_gpu_plan_predicts_the_nccl_buffers_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopart.compiler import compile
    from cost_models import memory
    from tests.distributed import REPO

    def predicted(channels: int) -> tuple[int, ...]:
        monkeypatch.setattr(memory, "NCCL_CHANNELS", channels)
        plan = compile(REPO / "examples" / "gpt.py", pp=2, microbatches=2, device="h200", time_limit_s=5)
        return plan.predicted.memory_bytes

    with_buffers, without = predicted(16), predicted(0)
    peers = 2  # the world's group of two ranks, and the pipeline neighbour
    assert [a - b for a, b in zip(with_buffers, without)] == [peers * 16 * NCCL_BUFFER_BYTES] * 2
