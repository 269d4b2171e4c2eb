"""Actions print and parse as torch's action strings; stages are placed in a loop over ranks."""

import pytest

from autopart.ir.errors import ScheduleError
from autopart.schedule import Action, Kind, stage_rank


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("1F0", Action(1, Kind.F, 0)),
        ("0B12", Action(0, Kind.B, 12)),
        ("3I2", Action(3, Kind.I, 2)),
        ("3W2", Action(3, Kind.W, 2)),
        ("0SEND_F3", Action(0, Kind.SEND_F, 3)),
        ("1RECV_F3", Action(1, Kind.RECV_F, 3)),
        ("12SEND_B0", Action(12, Kind.SEND_B, 0)),
        ("11RECV_B0", Action(11, Kind.RECV_B, 0)),
    ],
)
def test_str_and_parse_round_trip(text: str, action: Action) -> None:
    assert str(action) == text
    assert Action.parse(text) == action
    assert Action.parse(f"  {text}\n") == action


@pytest.mark.parametrize(
    "text", ["", "F0", "1F", "1X0", "1f0", "1F0x", "-1F0", "1F-1", "1 F0", "1SEND0", "1F0,1B0"]
)
def test_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ScheduleError, match="malformed action"):
        Action.parse(text)


def test_action_is_a_frozen_value() -> None:
    action = Action(2, Kind.F, 1)
    assert action == Action(2, Kind.F, 1)
    assert len({action, Action(2, Kind.F, 1), Action(2, Kind.B, 1)}) == 2
    with pytest.raises(AttributeError):
        action.stage = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("stage", "kind", "microbatch"), [(-1, Kind.F, 0), (0, Kind.F, -2), (0, "F", 0)]
)
def test_action_rejects_bad_fields(stage: int, kind: Kind, microbatch: int) -> None:
    with pytest.raises(ScheduleError):
        Action(stage, kind, microbatch)


def test_compute_and_communication_kinds() -> None:
    assert [k.value for k in Kind if k.is_compute] == ["F", "B", "I", "W"]
    assert not Action(0, Kind.SEND_F, 0).is_compute
    assert Action(0, Kind.W, 0).is_compute


@pytest.mark.parametrize(("text", "partner"), [("0SEND_F3", "1RECV_F3"), ("1RECV_F3", "0SEND_F3"),
                                              ("1SEND_B3", "0RECV_B3"), ("0RECV_B3", "1SEND_B3")])
def test_a_message_s_partner_is_its_other_end_and_back(text: str, partner: str) -> None:
    action = Action.parse(text)
    assert str(action.partner) == partner and action.partner.partner == action
    assert action.peer_stage == action.partner.stage


def test_only_messages_have_a_partner_and_the_first_stage_s_backward_send_has_no_peer() -> None:
    with pytest.raises(ScheduleError, match="0F1 is not a send or a receive"):
        Action.parse("0F1").partner
    assert Action.parse("0SEND_B1").peer_stage == -1  # a wrong schedule: validate names it
    with pytest.raises(ScheduleError, match="negative index"):
        Action.parse("0SEND_B1").partner


@pytest.mark.parametrize(
    ("stage", "ranks", "rank"),
    [(0, 1, 0), (5, 1, 0), (3, 4, 3), (4, 4, 0), (7, 4, 3), (9, 4, 1), (2, 2, 0)],
)
def test_stage_rank_is_loop_placement(stage: int, ranks: int, rank: int) -> None:
    assert stage_rank(stage, ranks) == rank


def test_stage_rank_rejects_nonsense() -> None:
    with pytest.raises(ScheduleError):
        stage_rank(0, 0)
    with pytest.raises(ScheduleError):
        stage_rank(-1, 2)
