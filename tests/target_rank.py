"""One rank of `tests.distributed.fork_ranks`, forked by the suite's zygote: the function named on
the command line, called as ``target(rank, port, *args)`` with this rank's place in the launch,
its arguments from JSON (a path as ``{"path": ...}``)."""

import importlib
import json
import os
import sys
from pathlib import Path

from tests.distributed import leave_after

module, name, encoded = sys.argv[1:4]
args = [Path(a["path"]) if isinstance(a, dict) else a for a in json.loads(encoded)]
leave_after(getattr(importlib.import_module(module), name), int(os.environ["RANK"]), int(os.environ["MASTER_PORT"]),
            *args)
