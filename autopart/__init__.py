"""autopart: a compiler for distributed training.

    plan = autopart.compile("examples/gpt.py", pp=2, microbatches=4)
    autopart.emit(plan, "out/gpt")      # then: torchrun --nproc-per-node 2 out/gpt/train.py

The compiler is imported on first use, so that the generated programs, which import only
``autopart.runtime``, start without loading the solver.
"""

from typing import Any

from autopart.ir.errors import AutopartError

__version__ = "0.1.0"

__all__ = ["compile", "emit", "CompileOptions", "Plan", "load_plan", "AutopartError", "__version__"]

_LAZY = {
    "compile": "autopart.driver",
    "emit": "autopart.driver",
    "CompileOptions": "autopart.options",
    "Plan": "autopart.ir.plan",
    "load_plan": "autopart.ir.plan",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        import random

        state = random.getstate()  # rich, which the compiler imports, draws from it when it is first imported
        try:
            module = importlib.import_module(_LAZY[name])
        finally:
            random.setstate(state)
        return getattr(module, name)
    raise AttributeError(f"module 'autopart' has no attribute {name!r}")
