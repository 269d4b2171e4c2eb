"""Messages between two ranks match in the order they are posted, so a schedule whose receiver
takes them in another order than its sender sends them must be refused before it runs."""

import pytest

from autopart.ir.errors import ScheduleError
from autopart.runtime.p2p import check_message_order
from autopart.schedule import Action, add_communication, build_schedule


@pytest.mark.parametrize(
    "kind, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1)]
)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_generated_schedules_send_in_the_order_they_receive(kind, chunks, ranks):
    for microbatches in (ranks, 2 * ranks, 3 * ranks):
        schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
        check_message_order(add_communication(schedule, ranks=ranks), ranks=ranks)


def test_receives_in_another_order_are_refused():
    # Rank 1 holds stages 1 and 3 and receives both activations from rank 0, the other way round.
    schedule = {
        0: [Action.parse(a) for a in ("0F0", "0SEND_F0", "2F0", "2SEND_F0")],
        1: [Action.parse(a) for a in ("3RECV_F0", "1RECV_F0", "1F0", "3F0")],
    }
    with pytest.raises(ScheduleError, match=r"rank 0 sends to rank 1 in another order than rank 1 receives: "
                                            r"message 0 is the activation 0->1 of microbatch 0 on the sender, "
                                            r"the activation 2->3 of microbatch 0 on the receiver"):
        check_message_order(schedule, ranks=2)
