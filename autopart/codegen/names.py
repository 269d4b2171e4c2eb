"""Names from the user's model on their way into generated code.

Parameter names enter the stage files as ``repr`` string literals, which are safe for any
string. Module paths and file names also appear in comments and docstrings, where a newline,
a quote or a backslash could end the comment or the string and turn the rest into code: they go
through ``plain_text``. Names that torch.fx itself cannot write back as code are refused before
tracing with a message that names them.
"""

from __future__ import annotations

from torch import nn

from autopart.ir.errors import CaptureError

__all__ = ["plain_text", "check_model_names"]

_UNSAFE = set("\"'\\`")


def plain_text(text: str) -> str:
    """``text`` as one line that cannot end a comment or a docstring: unsafe characters become '?'."""
    return "".join(c if c.isprintable() and c not in _UNSAFE else "?" for c in str(text))


def check_model_names(module: nn.Module, model_file: str) -> None:
    """Refuse submodule, parameter and buffer names that generated code could not hold as written."""
    named = [*module.named_modules(remove_duplicate=False)]
    named += [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, _ in named:
        if name != plain_text(name):
            raise CaptureError(
                f"{model_file} names a submodule or tensor {name!r}, with a quote, backslash or control character; "
                "rename it (ModuleDict keys and register_buffer names become names in the generated code)"
            )
