"""What a search's finalists measured here, kept so that compiling the same model again does not
launch them again.

Running the finalists (`autopart.profiling.finalists`) is the longest part of a first compile
on a small machine: every launch starts each rank's interpreter and torch for a second of
steps. Like the op profile (`autopart.profiling.measure_defaults`), what it measures belongs to
the machine and to what ran, so it is kept per machine and model file, each finalist under a
key of everything that decides what its launch runs:

- the plan's decisions (mesh, stages, schedule and its action lists, precision, sharding, ...),
  without its predicted figures, which move with a re-measured op profile while the programs
  do not;
- the model file's hash, how it was captured, and torch's version;
- the code that emits and runs the programs: a hash of autopart's own source, so an edited or
  upgraded autopart measures afresh;
- the machine: host, device, and the cores the ranks may run on.

A compile reads the cache only where every finalist is in it from one and the same run (one
run's figures beside another's, taken under another load, would judge the machine, not the
plans); ``--run-finalists`` always runs them afresh and writes what it measured. A launch that
failed is not kept, and takes out what an earlier run kept for its plan: a failure may be
passing (a port taken, a neighbour's memory), and a plan that failed last must run again. The
file is JSON, read back only as numbers; a record that is not well formed is left out, a file
that cannot be read is taken as empty, and one that cannot be written costs the next compile
a run of its finalists, not this one.

The key knows the files the model file imports from its folder too (`ModelSpec.sources_sha256`):
an edit to ``layers.py`` beside it runs the finalists afresh, as one to the model file does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import socket
import time
from pathlib import Path
from typing import Any

import torch

from autopart.ir.plan import Plan
from cost_models.calibration import cache_dir, cache_slug, usable_cores, write_json
from cost_models.devices import local_device_name

__all__ = ["Record", "cache_path", "finalist_key", "read_records", "write_records"]

Record = tuple[list[float], float]
"""A finalist's launch medians (seconds per step) and when they were measured (Unix time)."""

log = logging.getLogger("autopart")

_PREDICTED_STAGE_FIELDS = ("forward_s", "backward_s", "backward_weight_s")
_KEPT_PER_MODEL = 200  # records per model file and machine; the oldest go first


@functools.cache
def _source_digest() -> str:
    """A hash of autopart's own source: the code that emits and runs every finalist."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _machine(kind: str) -> list[Any]:
    return [socket.gethostname(), local_device_name(kind), usable_cores(), torch.__version__]


def finalist_key(plan: Plan, kind: str) -> str:
    """The key of ``plan``'s measured step on this machine's ``kind`` device ("cpu" or "cuda")."""
    data = plan.to_json()
    data.pop("predicted")
    data.pop("stage_sha256", None)
    provenance = data.pop("provenance")
    for stage in data["stages"]:
        for name in _PREDICTED_STAGE_FIELDS:
            stage.pop(name)
    data["model"] = [provenance["model_sha256"], provenance["sources_sha256"], provenance["capture"], provenance["leaves"]]
    data["code"] = _source_digest()
    data["machine"] = _machine(kind)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def cache_path(plan: Plan, kind: str) -> Path:
    """This machine's cache of measured finalists of ``plan``'s model file."""
    host = cache_slug(f"{socket.gethostname()}-{local_device_name(kind)}")
    stem = cache_slug(Path(plan.provenance.model_file).stem)
    return cache_dir() / "finalists" / f"{host}-{stem}-{plan.provenance.model_sha256[:16]}.json"


def _read(path: Path) -> dict[str, dict[str, Any]]:
    """The file's records that are well formed; none where it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: record for key, record in data.items() if _well_formed(record)}


def _well_formed(record: Any) -> bool:
    """Seconds that a step can take, and a time between the epoch and a day from now."""
    if not isinstance(record, dict):
        return False
    steps, at = record.get("steps_s"), record.get("at")
    return (isinstance(steps, list) and len(steps) > 0 and all(_number(s) and 0 < s < 1e6 for s in steps)
            and _number(at) and 0 <= at <= time.time() + 86400)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_records(plans: list[Plan], kind: str) -> list[Record] | None:
    """Each of ``plans``' cached record, in order; None unless every one is in the cache from
    one run (`write_records` gives a run's records one time)."""
    records = _read(cache_path(plans[0], kind))
    found = [records.get(finalist_key(plan, kind)) for plan in plans]
    if any(record is None for record in found) or len({record["at"] for record in found}) > 1:
        return None
    return [([float(s) for s in record["steps_s"]], float(record["at"])) for record in found]


def write_records(ran: list[tuple[Plan, list[float]]], failed: list[Plan], kind: str) -> None:
    """Keep in the cache each plan of ``ran`` with its launch medians, now as their time, and
    take out what it held for the plans that ``failed``. A cache that cannot be written is left
    as it was (the next compile runs its finalists again)."""
    plans = [plan for plan, _ in ran] + failed
    if not plans:
        return
    path = cache_path(plans[0], kind)
    records = _read(path)
    now = time.time()
    for plan, steps in ran:
        records[finalist_key(plan, kind)] = {"steps_s": steps, "at": now}
    for plan in failed:
        records.pop(finalist_key(plan, kind), None)
    kept = dict(sorted(records.items(), key=lambda item: item[1]["at"])[-_KEPT_PER_MODEL:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, kept)
    except OSError as error:
        log.warning(f"could not keep the finalists' steps in {path} ({error}); a compile of the same plans runs "
                    "them again")

