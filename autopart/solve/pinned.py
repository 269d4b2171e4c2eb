"""A plan given with ``--plan``: rebuilt for the model and checked field by field.

Automatic and hand-written plans are one type; this is how a hand-written one takes the
solver's place.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from autopart.ir.errors import ConfigError, PlanError, ScheduleError
from autopart.ir.plan import Plan
from autopart.ir.plan_difference import first_difference
from autopart.options import CompileOptions
from autopart.passes.front import Front, build_front
from autopart.schedule import keep_actions
from autopart.solve.assemble import pipeline_problem, plan_from_cuts

__all__ = ["rebuild_pinned", "check_same_model"]


def rebuild_pinned(options: CompileOptions, pinned: Plan) -> tuple[Plan, Front]:
    """The plan of ``--plan``, rebuilt for the model; refused in one line naming the first field
    that the model or the plan's other fields contradict."""
    check_same_model(options, pinned)
    try:
        options = replace(
            options,
            pp=pinned.mesh["pp"],
            tp=pinned.mesh["tp"],
            dp=pinned.mesh["dp"],
            schedule=pinned.schedule.kind,
            chunks=pinned.schedule.chunks,
            microbatches=pinned.schedule.microbatches,
            micro_batch_size=None,  # each replica's, which the global batch, microbatches and dp fix
            global_batch_size=pinned.schedule.global_batch_size,
            optimizer=pinned.optimizer,
            zero=pinned.zero,
            sp=pinned.sp,
            tp_overlap=pinned.tp_overlap,
            recompute=tuple(stage.recompute for stage in pinned.stages),
            dtype=pinned.dtype,
            capture=pinned.provenance.capture if pinned.provenance.capture in ("fx", "export") else None,
            leaf=pinned.provenance.leaves,
        )
        batch = options.batch_shape()
        front = build_front(options, batch[2])
        problem = pipeline_problem(options, front, batch[1])
        cuts = _pinned_cuts(pinned, options, front)
        plan = keep_actions(plan_from_cuts(options, front, problem, cuts, batch, ("pinned", 0.0, 0.0)), pinned)
    except (ConfigError, ScheduleError) as exc:
        raise PlanError(f"{options.plan} does not fit together: {exc}") from None
    difference = first_difference(pinned, plan)
    if difference is not None:
        field_path, given, expected = difference
        hint = _costs_hint(pinned.provenance.cost_model, plan.provenance.cost_model)
        raise PlanError(
            f"{options.plan}: {field_path} is {json.dumps(given)[:80]} but this model and the plan's other fields "
            f"give {json.dumps(expected)[:80]}{hint}; fix the field, or recompile without --plan"
        )
    return plan, front


def _costs_hint(given: str, here: str) -> str:
    """What the compile may change so that its costs are the plan's (they decide the sharding):
    the device where the plan was costed for another, else how its ops were costed, the roofline's
    (``--no-measure``) or measured ones (a same device's "pass its --device" sent the user nowhere)."""
    if given == here:
        return ""
    if given.partition(":")[2] != here.partition(":")[2]:
        fix = "pass its --device"
    elif given.startswith("roofline:"):
        fix = "compile with --no-measure, as it was"
    else:
        fix = "compile with its --costs, or measuring, as it was"
    return f" (it was costed with {given}, this compile with {here}: {fix})"


def check_same_model(options: CompileOptions, plan: Plan) -> None:
    """Refuse a plan compiled from another version of the model file, from the file's bytes alone:
    before the model is captured and costed, and before this machine's messages are measured."""
    try:
        source = Path(options.model).read_bytes()
    except OSError:
        return  # no file to read: loading it says why, in its own words
    if plan.provenance.model_sha256 != hashlib.sha256(source).hexdigest():
        name, compiled = Path(options.model).name, Path(plan.provenance.model_file).name
        if compiled and compiled != name:  # another model altogether, not an edit of this one
            raise PlanError(f"{options.plan} was compiled from {compiled}, not from {name}; give {compiled} with this "
                            "--plan, or recompile without --plan")
        raise PlanError(f"{options.plan} was compiled from another version of {name} (its model hash differs); "
                        "recompile without --plan")


def _pinned_cuts(plan: Plan, options: CompileOptions, front: Front) -> tuple[int, ...]:
    """The cuts of a hand-written or earlier plan, checked against this model."""
    block_ending_at = {b.nodes[-1]: k for k, b in enumerate(front.chain.blocks)}
    cuts = []
    for stage in plan.stages[:-1]:
        if not stage.nodes or stage.nodes[-1] not in block_ending_at:
            raise PlanError(
                f"plan stage {stage.index} does not end on a block of this model (it ends at node "
                f"{stage.nodes[-1] if stage.nodes else None!r}); move its last node to a block boundary or recompile"
            )
        cuts.append(block_ending_at[stage.nodes[-1]])
    if len(plan.stages) != options.pp * options.chunks or cuts != sorted(set(cuts)):
        raise PlanError(f"{options.plan} has {len(plan.stages)} stages out of order or not pp x chunks; recompile")
    return tuple(cuts)
