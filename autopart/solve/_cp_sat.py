"""OR-Tools' CP-SAT, imported at its first use.

Compiles that decide nothing (one stage, no tensor parallelism, or a ``--plan`` given) never
build a CP-SAT model, so they run where OR-Tools is not installed: on a GPU machine, say, that
profiles its ops and compiles a one-stage plan with the costs it measured
(``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["cp_model"]


class _Lazy:
    """Stands for ``ortools.sat.python.cp_model`` and imports it when an attribute is first read."""

    _module: ModuleType | None = None

    def __getattr__(self, name: str) -> Any:
        if _Lazy._module is None:
            _Lazy._module = importlib.import_module("ortools.sat.python.cp_model")
        return getattr(_Lazy._module, name)


cp_model: Any = _Lazy()
