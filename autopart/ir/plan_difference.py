"""Whether a plan given with ``--plan`` says what the plan rebuilt from it for the model says.

A plan given with ``--plan`` is rebuilt from its cuts and options (its figures predicted again);
a field that decides the programs and that the rebuilt plan does not share would otherwise be
dropped without a word (a stage's ``rank`` edited to 5 on a 2-stage plan).
"""

from __future__ import annotations

import json
from typing import Any

from autopart.ir.plan import Plan

__all__ = ["first_difference"]


_DECIDED = {
    "": ("mesh", "zero", "sp", "tp_overlap", "graph_inputs", "optimizer", "tied_parameters", "dtype"),
    "schedule": ("kind", "microbatches", "micro_batch_size", "global_batch_size", "chunks"),
    "provenance": ("capture", "leaves"),
}
_DECIDED_PER_STAGE = ("index", "rank", "blocks", "nodes", "inputs", "outputs", "batch_inputs", "parameters",
                      "strategies", "overlapped", "parameter_placements", "recompute", "parameter_bytes",
                      "no_grad_inputs")


def first_difference(pinned: Plan, rebuilt: Plan) -> tuple[str, Any, Any] | None:
    """The first field that decides the programs where a pinned plan and the plan rebuilt from it
    for the model differ: its path, the pinned value, the model's. None when they agree."""
    mine, theirs = pinned.to_json(), rebuilt.to_json()
    if not any("split_dim" in meta for stage in mine["stages"] for _, meta in (*stage["inputs"], *stage["outputs"])):
        for stage in theirs["stages"]:  # a plan written before slices crossed stages: the rebuilt one decides them
            for _, meta in (*stage["inputs"], *stage["outputs"]):
                meta.pop("split_dim", None)
    for part, keys in _DECIDED.items():
        for key in keys:
            a, b = (mine[part][key], theirs[part][key]) if part else (mine[key], theirs[key])
            if a != b:
                return (f"plan.{part}.{key}" if part else f"plan.{key}"), a, b
    if len(mine["stages"]) != len(theirs["stages"]):
        return "plan.stages", len(mine["stages"]), len(theirs["stages"])
    old_plan = not any("no_grad_inputs" in stage for stage in mine["stages"])
    for index, (a, b) in enumerate(zip(mine["stages"], theirs["stages"])):
        # written only where there are some; a plan written before it was: the rebuilt one decides them
        a, b = ({"no_grad_inputs": b.get("no_grad_inputs", []) if old_plan else [], **stage} for stage in (a, b))
        for key in _DECIDED_PER_STAGE:
            if a[key] != b[key]:
                if isinstance(a[key], dict) and isinstance(b[key], dict):  # name the entry: the whole may be long
                    name = next(k for k in sorted({*a[key], *b[key]}) if a[key].get(k) != b[key].get(k))
                    return f"plan.stages[{index}].{key}.{name}", a[key].get(name), b[key].get(name)
                if isinstance(a[key], list) and isinstance(b[key], list) and max(map(_shown, (a[key], b[key]))) > 80:
                    # a stage's nodes: shown whole, cut short, the two read alike up to where they differ
                    at = next((i for i, (x, y) in enumerate(zip(a[key], b[key])) if x != y), min(len(a[key]), len(b[key])))
                    return (f"plan.stages[{index}].{key}[{at}]", a[key][at] if at < len(a[key]) else None,
                            b[key][at] if at < len(b[key]) else None)
                return f"plan.stages[{index}].{key}", a[key], b[key]
    return None


def _shown(value: Any) -> int:
    """The length of ``value`` as a message shows a field (JSON), which cuts it at 80 characters."""
    return len(json.dumps(value))
