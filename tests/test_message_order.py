"""Messages between two ranks match in the order they are posted (activations and gradients each
on their own channel), so a schedule whose receiver takes them in another order than its sender
sends them must be refused before it runs."""

import pytest

from autopart.ir.errors import ScheduleError
from autopart.schedule import Action, add_communication, build_schedule, check_message_order, stage_placement


@pytest.mark.parametrize(
    "kind, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zbv", 2)]
)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_generated_schedules_send_in_the_order_they_receive(kind, chunks, ranks):
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    for microbatches in (ranks, 2 * ranks, 3 * ranks):
        if kind == "zbv" and microbatches < 2 * ranks - 1:
            continue
        schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
        lowered = add_communication(schedule, ranks=ranks, placement=placement)
        check_message_order(lowered, ranks=ranks, placement=placement)


def test_receives_in_another_order_are_refused():
    # Rank 1 holds stages 1 and 3 and receives both activations from rank 0, the other way round.
    schedule = {
        0: [Action.parse(a) for a in ("0F0", "0SEND_F0", "2F0", "2SEND_F0")],
        1: [Action.parse(a) for a in ("3RECV_F0", "1RECV_F0", "1F0", "3F0")],
    }
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: 3RECV_F0 receives out of order: activation message 0 "
                                            r"from rank 0 is 0SEND_F0; exchange the messages in the same order"):
        check_message_order(schedule, ranks=2)


def test_zbv_mixes_directions_that_each_stay_in_order():
    # Under ZB-V rank 0 sends rank 1 chunk 0's activations and chunk 1's gradients in an order
    # that rank 1 does not receive them in; apart, each direction is in order (the runtime
    # sends them on two process groups).
    placement = stage_placement("zbv", ranks=2, chunks=2)
    lowered = add_communication(build_schedule("zbv", ranks=2, microbatches=4, chunks=2), ranks=2, placement=placement)
    sent = [str(a) for a in lowered[0] if a.kind.value.startswith("SEND")]
    received = [str(a.partner) for a in lowered[1] if a.kind.value.startswith("RECV")]
    assert sent != received
    check_message_order(lowered, ranks=2, placement=placement)
