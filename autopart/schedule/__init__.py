"""Pipeline schedules: which rank runs which forward and backward, in what order, and when.

The pass takes the plan's schedule choice (kind, ranks, microbatches, chunks) and gives the
per-rank action lists that the runtime executes, plus a simulated `Timeline`. In order:
`build_schedule` (compute actions) -> `add_communication` (sends and receives) -> `validate`
(no missing action, no broken dependency, no deadlock) -> `simulate` (when each action runs)
-> `write_chrome_trace` / `write_gantt_png` / `write_schedule_csv`.
"""

from autopart.ir.actions import COMM_KINDS, COMPUTE_KINDS, RECEIVE_KINDS, Action, Kind, Schedule, rank_of, stage_rank, v_stage_rank
from autopart.schedule.generators import (MOST_MICROBATCHES, SCHEDULE_KINDS, SPLIT_BACKWARD_KINDS, build_schedule,
                                          stage_placement)
from autopart.schedule.lowering import add_communication
from autopart.schedule.simulate import Event, Timeline, simulate, simulated_events
from autopart.schedule.stage_costs import StageCosts
from autopart.schedule.trace import (
    chrome_trace_events,
    read_chrome_trace,
    read_schedule_csv,
    write_chrome_trace,
    write_gantt_png,
    write_schedule_csv,
)
from autopart.schedule.stored import (
    action_lists, built, built_lowered, generated, keep_actions, plan_actions, validation_beside, worth_forking,
)
from autopart.schedule.validate import check_message_order, format_grid, validate

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "stage_rank",
    "v_stage_rank",
    "rank_of",
    "stage_placement",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "RECEIVE_KINDS",
    "SCHEDULE_KINDS",
    "SPLIT_BACKWARD_KINDS",
    "MOST_MICROBATCHES",
    "build_schedule",
    "add_communication",
    "validate",
    "check_message_order",
    "action_lists",
    "plan_actions",
    "validation_beside",
    "worth_forking",
    "built",
    "built_lowered",
    "generated",
    "keep_actions",
    "format_grid",
    "StageCosts",
    "Event",
    "Timeline",
    "simulate",
    "simulated_events",
    "chrome_trace_events",
    "write_chrome_trace",
    "read_chrome_trace",
    "write_gantt_png",
    "write_schedule_csv",
    "read_schedule_csv",
]
