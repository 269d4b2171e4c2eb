"""The model-file contract: import a user's ``model.py`` and check what it defines.

Both the compiler and every rank of a generated program load the model file, so the loader
lives here, below the passes and the runtime alike.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
import traceback
from functools import cached_property
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopart.ir.errors import ModelFileError, read_user_file

__all__ = ["MODULE_PREFIX", "ModelSpec", "import_name", "files_beside", "load_model_file", "check_batch", "describe_error", "file_line", "USER_CODE_ERRORS", "eager_loss", "is_meta"]

MODULE_PREFIX = "_autopart_model_"
"""The start of the name a model file is imported under (the rest a digest of its path): its
functions and classes are known by it in the compile alone."""


def import_name(path: Path) -> str:
    """The name ``path`` is imported under (`MODULE_PREFIX` and a digest of its resolved path)."""
    return f"{MODULE_PREFIX}{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"


def _imported_beside(folder: str) -> list[str]:
    """The modules imported so far that a model file in ``folder`` imports from there (their top
    package is a file or folder there), whichever file each was first imported from: the model file
    is imported with its folder first on the path, and such a module is imported again with it, so
    that a process that imports model files twice (the Python API, a notebook, a test run) reads a
    file beside one as it is now, not as it was first (nor another folder's file of that name). The
    standard library, torch and autopart are never taken for one. The folder is listed once, not
    asked about each module imported."""
    tops = _tops_beside(folder)
    return [name for name in sys.modules if name.partition(".")[0] in tops]


def _tops_beside(folder: str) -> set[str]:
    """The names a module or package in ``folder`` is imported by (a ``.py`` file, a folder with an
    ``__init__.py``), but the standard library's, torch's and autopart's."""
    there = Path(folder)
    tops = {p.stem for p in there.glob("*.py")} | {p.parent.name for p in there.glob("*/__init__.py")}
    return {top for top in tops if top not in sys.stdlib_module_names and top not in ("torch", "autopart")
            and not top.startswith(("__", MODULE_PREFIX))}


def _imports_beside(path: Path, source: bytes, imported: set[str]) -> tuple[str, ...]:
    """The modules and packages of the model file's folder that it imports: those its import
    brought in (``imported``: new in ``sys.modules``, a module beside it importing another too),
    and those its own code names in an import statement, in a function too (a lazy import in
    ``batches``, which the compile never runs), but not under ``if __name__ == "__main__":``, which
    runs only as a script (the user's own ``train.py`` beside it, say)."""
    tops = _tops_beside(str(path.parent)) - {path.stem}
    named = set()
    try:
        for node in _outside_main(ast.parse(source)):
            if isinstance(node, ast.Import):
                named |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named.add(node.module.partition(".")[0])
    except (SyntaxError, ValueError):  # it imported: Python read it, as a version of its own may not
        pass
    return tuple(sorted(tops & ({name.partition(".")[0] for name in imported} | named)))


_SCRIPT_TESTS = ('__name__ == "__main__"', '"__main__" == __name__')


def _outside_main(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but those of its ``if __name__ == "__main__":`` blocks, written
    either way round (``if "__main__" == __name__:`` runs as a script alike)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') in _SCRIPT_TESTS:
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _outside_main(node)


def files_beside(spec: ModelSpec) -> dict[str, Path]:
    """The source files of the modules and packages that the model file imports from its own
    folder (``ModelSpec.beside``: ``from layers import Block``), whole packages' ``.py`` files, by
    their path relative to that folder. The output directory carries them beside its copy of the
    model file, which imports them, as the stage programs import the functions of theirs that the
    captured code calls: they are the model, and the folder they came from may not be there
    where it trains."""
    folder = spec.path.absolute().parent
    found = {}
    for top in spec.beside:
        if (folder / f"{top}.py").is_file():
            found[f"{top}.py"] = folder / f"{top}.py"
        for file in (folder / top).rglob("*.py") if (folder / top / "__init__.py").is_file() else ():
            if "__pycache__" not in file.relative_to(folder).parts:
                found[file.relative_to(folder).as_posix()] = file
    return dict(sorted(found.items()))


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What a user's ``model.py`` provides, checked against the contract."""

    path: Path
    source_sha256: str
    module: nn.Module | None  # None when loaded for its data functions only
    example_batch: Callable[[int], tuple[tuple[Any, ...], Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    batches: Callable[[int, int], Iterator[tuple[tuple[Any, ...], Any]]] | None
    eval_batches: Callable[[int, int], Iterator[tuple[tuple[Any, ...], Any]]] | None = None  # held-out data
    init_weights: Callable[[nn.Module], None] | None = None  # for models built on the meta device
    beside: tuple[str, ...] = ()  # the modules and packages it imports from its folder (`files_beside`)

    @cached_property
    def sources_sha256(self) -> str:
        """The hash of the model as measurements of it rest on: its file's and, where it imports
        modules from its folder, theirs (an edit to ``layers.py`` beside it changes the model as
        much as one to the file); the file's hash alone where it imports none. Taken once per
        load: the search asks it per candidate, and a file edited during the compile must not
        move the key between a measurement's save and its lookup. Files the model reads as data
        (a config.json beside it) are not in it."""
        if not self.beside:
            return self.source_sha256
        digest = hashlib.sha256(self.source_sha256.encode())
        for name, file in files_beside(self).items():
            digest.update(f"\0{name}\0{hashlib.sha256(file.read_bytes()).hexdigest()}".encode())
        return digest.hexdigest()

    @cached_property
    def sample_bytes(self) -> int | None:
        """The bytes one sample of the example batch takes (every tensor of it has the batch
        first, so a batch of B takes B times as many); None where ``example_batch(1)`` fails (a
        batch that is built will say why, if it fails too)."""
        try:
            inputs, target = self.example(1)
        except ModelFileError:
            return None
        return sum(t.numel() * t.element_size() for t in (*inputs, target) if isinstance(t, torch.Tensor))

    def example(self, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The example batch at ``batch_size``, checked to be ``(tuple of tensors, target)``."""
        try:
            batch = self.example_batch(batch_size)
        except USER_CODE_ERRORS as exc:  # the user's code may raise anything
            raise ModelFileError(f"example_batch({batch_size}) in {self.path.name} raised "
                                 f"{describe_error(exc, self.path)}; fix example_batch()") from None
        return check_batch(self.path, "example_batch", batch, batch_size)


def file_line(exc: BaseException, path: Path) -> str | None:
    """``model.py:LINE`` of the innermost traceback frame that lies in the user's file."""
    where = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            where = f"{path.name}:{frame.lineno}"
    return where


USER_CODE_ERRORS = (Exception, SystemExit)
"""What a call into the model file may raise: SystemExit too (a script's argparse or sys.exit() run
on import), which ended the command with the file's exit code, 0 included, and no word."""


def describe_error(exc: BaseException, path: Path) -> str:
    if isinstance(exc, SystemExit):
        where = file_line(exc, path)
        return f"SystemExit({exc.code!r})" + (f" ({where})" if where else "")
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = file_line(exc, path)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"{text} ({where})" if where else text


def load_model_file(path: str | Path, *, build: bool = True) -> ModelSpec:
    """Import ``path`` and return its ``ModelSpec``; every breach of the contract is a ModelFileError.

    ``build=False`` skips ``build_model()``: the runtime needs only the data functions.
    """
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(f"model file '{path}' is a directory; pass the path of the Python file in it that "
                             "defines build_model() and example_batch()")
    if not path.is_file():
        raise ModelFileError(
            f"model file '{path}' does not exist; pass the path of a Python file that defines "
            "build_model() and example_batch()"
        )
    if path.suffix != ".py":
        raise ModelFileError(f"model file '{path}' is not a .py file; pass a Python model file")
    source = read_user_file(path, ModelFileError, "model file", "make it readable, or pass a copy that is")
    name = import_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    for stale in _imported_beside(folder):  # imported afresh, as in a new process
        sys.modules.pop(stale)
    sys.path.insert(0, folder)
    before = set(sys.modules)
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except USER_CODE_ERRORS as exc:  # the user's code may raise anything
        sys.modules.pop(name, None)
        fix = ("the file exits as it is imported; keep what it does as a script under if __name__ == '__main__':"
               if isinstance(exc, SystemExit) else "fix the model file")
        raise ModelFileError(f"importing {path.name} failed: {describe_error(exc, path)}; {fix}") from None
    finally:
        sys.path.remove(folder)
    beside = _imports_beside(path, source, set(sys.modules) - before)
    if beside and folder not in sys.path:  # its functions may import them when called (batches' data source):
        sys.path.append(folder)  # found there, after every other place, where nothing else is

    build_model = _contract_function(module, path, "build_model", required=True)
    example_batch = _contract_function(module, path, "example_batch", required=True)
    loss_fn = _contract_function(module, path, "loss_fn", required=False)
    batches = _contract_function(module, path, "batches", required=False)
    eval_batches = _contract_function(module, path, "eval_batches", required=False)
    init_weights = _contract_function(module, path, "init_weights", required=False)
    model = None
    try:
        if build:
            with _NoRandomFillsOnMeta():
                model = build_model()
    except USER_CODE_ERRORS as exc:
        raise ModelFileError(f"build_model() in {path.name} raised {describe_error(exc, path)}; fix build_model()") from None
    if build and not isinstance(model, nn.Module):
        raise ModelFileError(
            f"build_model() in {path.name} returned {type(model).__name__}, not a torch.nn.Module; "
            "return the model instance"
        )
    return ModelSpec(
        path=path,
        source_sha256=hashlib.sha256(source).hexdigest(),
        module=model,
        example_batch=example_batch,
        loss_fn=loss_fn,
        batches=batches,
        eval_batches=eval_batches,
        init_weights=init_weights,
        beside=beside,
    )


class _NoRandomFillsOnMeta(torch.overrides.TorchFunctionMode):
    """Skips ``nn.init.normal_``, ``uniform_`` and ``kaiming_uniform_`` on meta tensors while a model
    builds: they hold no values to fill, and on the meta device each fill runs torch's Python
    reference of the op (a 1,024-layer model's ``nn.Linear`` initialisers took seconds of a
    compile). A mode sees the ``nn.init`` function itself, not the tensor method it calls. Every
    other op, every fill of a real tensor, and a ``kaiming_uniform_`` that would refuse its tensor
    (fewer than two dimensions: its fans) run as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init hands its tensor over by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta and \
                    (func is not nn.init.kaiming_uniform_ or tensor.dim() >= 2):
                return tensor
        return func(*args, **kwargs)


_RANDOM_FILLS = frozenset({nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_})


def _contract_function(module: Any, path: Path, name: str, *, required: bool) -> Callable | None:
    fn = getattr(module, name, None)
    if fn is None:
        if required:
            signature = {
                "build_model": "def build_model() -> nn.Module",
                "example_batch": "def example_batch(batch_size: int) -> (inputs: tuple, target)",
            }[name]
            raise ModelFileError(
                f"{path.name} does not define {name}(); add `{signature}` (see the model-file contract in the README)"
            )
        return None
    if not callable(fn):
        raise ModelFileError(f"{name} in {path.name} is a {type(fn).__name__}, not a function; define it with def")
    if name == "build_model" and isinstance(fn, nn.Module):  # callable: build_model() would run its forward
        raise ModelFileError(f"build_model in {path.name} is a {type(fn).__name__} instance, not a function that "
                             f"returns the model; define it with def, as `def build_model(): return "
                             f"{type(fn).__name__}(...)`")
    return fn


def check_batch(path: Path, producer: str, batch: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Check one ``(inputs, target)`` pair from the model file and return it normalised."""
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        if isinstance(batch, tuple | list):  # the inputs given one by one, not in a tuple of their own
            raise ModelFileError(f"{producer}() in {path.name} returned a {type(batch).__name__} of {len(batch)} items; "
                                 "it must return two, (inputs: tuple, target): the model's inputs in one tuple, then "
                                 "the target")
        raise ModelFileError(
            f"{producer}() in {path.name} returned {type(batch).__name__}; it must return (inputs: tuple, target)"
        )
    inputs, target = batch
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple | list) or not inputs:
        raise ModelFileError(f"{producer}() in {path.name} must return a non-empty tuple of input tensors first")
    for i, tensor in enumerate([*inputs, target]):
        if tensor is None and i == len(inputs):
            continue
        what = f"input {i}" if i < len(inputs) else "the target"
        if not isinstance(tensor, torch.Tensor):
            raise ModelFileError(
                f"{producer}() in {path.name}: {what} is a {type(tensor).__name__}, not a tensor; "
                "inputs and target must be tensors whose first dimension is the batch"
            )
        if tensor.dim() == 0 or tensor.shape[0] != batch_size:
            raise ModelFileError(
                f"{producer}({batch_size}) in {path.name}: {what} has shape {tuple(tensor.shape)}, "
                f"whose first dimension is not the batch size {batch_size}"
            )
        if tensor.is_meta:  # the batch is data: every rank and the reference compute on it
            raise ModelFileError(f"{producer}() in {path.name}: {what} is on the meta device; return tensors on the "
                                 "CPU (a model may be built on the meta device, its batches may not)")
    return tuple(inputs), target


def is_meta(module: nn.Module) -> bool:
    """Whether the model was built on the meta device: shapes without storage."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def eager_loss(spec: ModelSpec, inputs: tuple[torch.Tensor, ...], target: Any,
               weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The loss of the original model, run eagerly: the reference that every graph must match.
    ``weights``: tensors to run it with in place of its parameters, by name (working copies)."""
    output = torch.func.functional_call(spec.module, weights, inputs) if weights else spec.module(*inputs)
    return output if spec.loss_fn is None else spec.loss_fn(output, target)
