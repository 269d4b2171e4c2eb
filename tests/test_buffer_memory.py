"""What a stage holds for each buffer it reads (`autopart.predict.memory.held_buffer_bytes`): its
bytes, and for a buffer that the forward updates what the runtime keeps of it through a step."""

import pytest
import torch
from torch import nn

from autopart.ir.tensors import tensor_meta
from autopart.predict.memory import held_buffer_bytes
from autopart.runtime.buffer_updates import BufferUpdates


@pytest.mark.parametrize("dtype, extra", [(torch.float32, 2), (torch.bfloat16, 3), (torch.float64, 2),
                                          (torch.int8, 17), (torch.int64, 3), (torch.bool, 9)])
def test_an_updated_buffer_costs_what_the_runtime_keeps_of_it_through_a_step(dtype, extra):
    module = nn.Module()
    module.register_buffer("counter", torch.zeros(1000, dtype=dtype))
    updates = BufferUpdates(module, updated=("counter",))
    for _ in range(3):  # microbatches: the start copy and the sums live from the first to the step's end
        with updates.forward():
            module.counter.data.copy_(torch.ones_like(module.counter))
    with updates.forward():
        pass
    kept = sum(t.nbytes for t in (*updates.start.values(), *updates.sums.values()))
    meta = tensor_meta(module.counter)
    assert held_buffer_bytes(meta, updated=True) == meta.nbytes + kept == (1 + extra) * meta.nbytes
    assert held_buffer_bytes(meta, updated=False) == meta.nbytes
