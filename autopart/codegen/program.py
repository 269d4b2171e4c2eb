"""Python statements from fx nodes, written for a reader: public names, attribute paths, shape comments.

torch.fx's own code generator writes what the interpreter needs (``torch._C._nn.linear``,
``getattr(self.layers, "0")``, a clear of every value after its last use). The stage programs are
read and edited by people, so they are written here instead: functions under the names their
documentation uses (``F.linear``, ``torch.rsqrt``), keyword arguments that equal their defaults
left out, parameters read where they are used (``self.layers[0].attention.wq.weight``), and the
shape and dtype of each tensor in a comment on the line that makes it.
"""

from __future__ import annotations

import builtins
import inspect
import keyword
import math
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx

from autopart.ir.errors import PlanError
from autopart.ir.model_file import MODULE_PREFIX
from autopart.solve.sharding import op_name

__all__ = ["Step", "Memory", "Expressions", "attribute_path", "function_lines", "shape_comment", "large", "LARGE_OPS", "VIEW_OPS"]

LARGE_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "scaled_dot_product_attention", "sharded_attention",
    "conv1d", "conv2d", "conv3d", "embedding", "cross_entropy", "softmax", "log_softmax",
    "vocab_parallel_embedding", "vocab_parallel_cross_entropy",
})  # fmt: skip
"""Ops whose outputs (or workspaces) are large: a value still referenced while one runs holds its memory through it."""

_OPERATORS = {
    "add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "truediv": "{} / {}", "floordiv": "{} // {}",
    "mod": "{} % {}", "pow": "{} ** {}", "matmul": "{} @ {}", "getitem": "{}[{}]", "neg": "-{}",
    "eq": "{} == {}", "ne": "{} != {}", "lt": "{} < {}", "gt": "{} > {}", "le": "{} <= {}", "ge": "{} >= {}",
    "and_": "{} & {}", "or_": "{} | {}", "xor": "{} ^ {}", "invert": "~{}", "lshift": "{} << {}", "rshift": "{} >> {}",
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Step:
    """One statement of a generated function."""

    defines: str | None  # the fx node whose value the statement binds
    text: str
    uses: tuple[str, ...]  # the fx nodes whose values it reads
    large: bool  # it runs a large op (or a layer)
    comment: str = ""  # the shape and dtype of what it binds
    path: str | None = None  # the module of the model it belongs to ("" the function's own), for a ``# path`` line


def attribute_path(root: str, path: str, *, indexable: Callable[[str], bool]) -> str:
    """``self.layers[0].attention`` for ``layers.0.attention``; ``getattr`` only where a name is no identifier."""
    text, walked = root, []
    for part in path.split("."):
        if part.isdigit() and indexable(".".join(walked)):
            text += f"[{int(part)}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            text += f".{part}"
        else:
            text = f"getattr({text}, {part!r})"
        walked.append(part)
    return text


class Expressions:
    """Writes the right-hand side of a node's statement, collecting the imports it needs."""

    def __init__(self, *, variable: Callable[[fx.Node], str], attribute: Callable[[fx.Node], str]):
        self.variable = variable  # the expression of a value node: its variable name
        self.attribute = attribute  # the expression of a get_attr node (or a call_module's module)
        self.imports: set[str] = set()
        self.from_model: set[str] = set()  # the model file's own functions and classes, by qualified name

    def callee(self, node: fx.Node) -> str | None:
        """The name a call_function node calls its function by, when it is written as a call."""
        target = node.target
        if node.op != "call_function" or target is builtins.getattr or getattr(target, "__module__", None) == "_operator":
            return None
        return self.function(target)

    def of(self, node: fx.Node) -> str:
        if node.op == "call_method":
            receiver, *rest = node.args
            return f"{self.argument(receiver)}.{node.target}({self.arguments(tuple(rest), node.kwargs)})"
        if node.op == "call_module":
            return f"{self.attribute(node)}({self.arguments(node.args, node.kwargs)})"
        if node.op == "get_attr":
            return self.attribute(node)
        assert node.op == "call_function", node.op
        target = node.target
        if getattr(target, "__module__", None) == "_operator" and target.__name__ in _OPERATORS and not node.kwargs:
            return _OPERATORS[target.__name__].format(*(self.argument(a) for a in node.args))
        if target is builtins.getattr and len(node.args) == 2 and str(node.args[1]).isidentifier():
            return f"{self.argument(node.args[0])}.{node.args[1]}"
        kwargs = _without_defaults(target, node.kwargs)
        args = node.args
        if target is F.linear and len(args) == 3 and args[2] is None:  # no bias: say nothing of it
            args = args[:2]
        return f"{self.function(target)}({self.arguments(args, kwargs)})"

    def function(self, target: Any) -> str:
        """The name a reader knows the function by, importing what that name needs."""
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            module = _defining_module(target)
            if module is not None and not module.startswith(MODULE_PREFIX):  # the model file's: loaded for its loss
                self.imports.add(f"import {module}")
            return f"torch.ops.{target}"
        module = getattr(target, "__module__", None)
        if module == "autopart.runtime.collectives":  # read as tp.all_reduce(x)
            self.imports.add("from autopart.runtime import collectives as tp")
            return f"tp.{target.__name__}"
        if module == "autopart.runtime.overlapped":  # read as overlapped.gathered_linear(x, ...)
            self.imports.add("from autopart.runtime import overlapped")
            return f"overlapped.{target.__name__}"
        name = getattr(target, "__name__", None)
        if isinstance(name, str):
            if getattr(F, name, None) is target:
                self.imports.add("import torch.nn.functional as F")
                return f"F.{name}"
            for module in (torch, torch.special, torch.linalg, torch.fft):
                if getattr(module, name, None) is target:
                    return f"{module.__name__}.{name}"
            if getattr(builtins, name, None) is target or getattr(math, name, None) is target:
                if getattr(math, name, None) is target:
                    self.imports.add("import math")
                    return f"math.{name}"
                return name
        module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
        if not module or not qualname or not _dotted(module) or not _dotted(qualname):
            raise PlanError(f"generated code would need {target!r}, which cannot be imported by name; report this model")
        if module.startswith(MODULE_PREFIX):  # the model file's own (an fx.wrap function, an output dataclass)
            self.from_model.add(qualname)  # read from OUT/model.py at run time: the compile's import name is its own
            return qualname.replace(".", "_")
        if "." in qualname:  # a static method: reached through its class's module
            self.imports.add(f"import {module}")
            return f"{module}.{qualname}"
        alias = f"{module.rpartition('.')[2]}_{qualname}" if qualname in ("F", "torch", "tp", "math") else qualname
        self.imports.add(f"from {module} import {qualname}" + (f" as {alias}" if alias != qualname else ""))
        return alias

    def arguments(self, args: tuple, kwargs: dict[str, Any]) -> str:
        return ", ".join([*(self.argument(a) for a in args), *(f"{k}={self.argument(v)}" for k, v in kwargs.items())])

    def argument(self, value: Any) -> str:
        if isinstance(value, fx.Node):
            return self.attribute(value) if value.op == "get_attr" else self.variable(value)
        if isinstance(value, tuple):
            return "(" + ", ".join(self.argument(v) for v in value) + ("," if len(value) == 1 else "") + ")"
        if isinstance(value, list):
            return "[" + ", ".join(self.argument(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{self.argument(k)}: {self.argument(v)}" for k, v in value.items()) + "}"
        if isinstance(value, slice):
            return f"slice({self.argument(value.start)}, {self.argument(value.stop)}, {self.argument(value.step)})"
        if isinstance(value, float) and not math.isfinite(value):
            return f"float({str(value)!r})"
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return str(value)  # torch.float32
        if isinstance(value, torch.device):
            return f"torch.device({str(value)!r})"
        if value is Ellipsis or value is None or isinstance(value, (bool, int, float, str, complex)):
            return repr(value)
        if isinstance(value, torch._ops.OpOverload):
            return f"torch.ops.{value}"
        raise PlanError(f"generated code would need the constant {value!r}, which has no source form; report this model")


def _defining_module(op: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> str | None:
    """The Python module that defined ``op`` with ``torch.library.custom_op`` (transformers' MoE
    ``torch.ops.transformers.grouped_mm_fallback``): a rank that has not imported it has no such op,
    and a library may import it lazily, only when the model class is first reached."""
    from torch._library.custom_ops import OPDEFS

    packet = op if isinstance(op, torch._ops.OpOverloadPacket) else op.overloadpacket
    definition = OPDEFS.get(packet._qualified_op_name)
    module = getattr(getattr(definition, "_init_fn", None), "__module__", None)
    return module if isinstance(module, str) and _dotted(module) else None


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _without_defaults(target: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` less those that equal the function's default (``inplace=False``): they say nothing."""
    if not kwargs or not isinstance(target, types.FunctionType):
        return dict(kwargs)
    try:
        defaults = {k: p.default for k, p in inspect.signature(target).parameters.items() if p.default is not p.empty}
    except (TypeError, ValueError):
        return dict(kwargs)

    def default(key: str, value: Any) -> bool:
        return key in defaults and type(defaults[key]) is type(value) and defaults[key] == value

    return {k: v for k, v in kwargs.items() if isinstance(v, fx.Node) or not default(k, v)}


VIEW_OPS = frozenset({
    "view", "reshape", "transpose", "permute", "getitem", "chunk", "split", "unbind", "expand", "expand_as",
    "unsqueeze", "squeeze", "t", "flatten", "unflatten", "narrow", "select", "view_as", "reshape_as", "detach",
    "contiguous", "to", "type_as", "float", "as_strided", "copy_to_tp", "copy_weight_to_tp", "copy_for_products", "all_reduce",
})  # fmt: skip
"""Ops whose output may share its input's storage (``tp.copy_to_tp`` and ``tp.copy_for_products`` are the identity in forward):
clearing one name of the two frees nothing."""


@dataclass(frozen=True, kw_only=True)
class Memory:
    """What the clears of one function need to know about its values."""

    sizes: dict[str, int]  # elements of each tensor value
    roots: dict[str, str]  # each value -> the value whose storage it may share (itself, for a fresh one)
    threshold: int  # a value smaller than this (the function's inputs and outputs) is not worth a line


def function_lines(signature: str, steps: list[Step], *, parameters: set[str], memory: Memory,
                   variable: Callable[[str], str], depth: int = 2) -> list[str]:  # fmt: skip
    """A function: its ``def`` line, then its steps, with ``# module`` lines and the clears worth keeping.

    Reference clears (``del``): a value's storage is released after the last use of every name
    that shares it, only where that storage is at least as large as the function's inputs and
    outputs (the residual stream, in a layer) and a large op (a matrix product, attention, an
    embedding, a layer) still follows in the same function. Autograd keeps what backward needs
    whatever the code does; what it does not keep (and everything in recompute's first, no-grad
    pass and in evaluation) would otherwise stay referenced by this frame through that op, at
    its peak. After the last large op nothing is cleared: the frame returns and frees it all. A
    clear of every value after its last use (torch.fx's habit) would bury the code in ``= None``.
    """
    indent = "    " * depth
    lines = [f"{'    ' * (depth - 1)}{signature}"]
    defined = {step.defines: i for i, step in enumerate(steps) if step.defines}
    group_end: dict[str, int] = {}
    for name, i in defined.items():
        group_end[memory.roots.get(name, name)] = max(group_end.get(memory.roots.get(name, name), -1), i)
    for i, step in enumerate(steps):
        for name in step.uses:
            root = memory.roots.get(name, name)
            group_end[root] = max(group_end.get(root, -1), i)
    members: dict[str, list[str]] = {}
    for name in defined:
        members.setdefault(memory.roots.get(name, name), []).append(name)
    last_large = max((i for i, step in enumerate(steps) if step.large), default=-1)
    ending: dict[int, list[str]] = {}  # per step, the storages whose last use it is
    for root, end in group_end.items():
        ending.setdefault(end, []).append(root)
    current_path = None
    for i, step in enumerate(steps):
        if step.path is not None and step.path != current_path:
            if step.path:
                lines.append(f"{indent}# {step.path}")
            current_path = step.path
        lines.append(f"{indent}{step.text}" + (f"  # {step.comment}" if step.comment else ""))
        if i >= last_large:
            continue
        bound = variable(step.defines) if step.defines else None
        dead = [
            variable(name)
            for root in ending.get(i, ()) if root in defined and root not in parameters
            and memory.sizes.get(root, 0) >= memory.threshold
            for name in members[root] if defined[name] <= i and variable(name) != bound
        ]  # fmt: skip
        if dead:
            lines.append(f"{indent}del {', '.join(dict.fromkeys(dead))}")
    return lines


def shape_comment(shape: tuple[int, ...], dtype: str) -> str:
    return f"{list(shape)} {dtype}"


def large(node: fx.Node) -> bool:
    return node.op == "call_module" or op_name(node) in LARGE_OPS

