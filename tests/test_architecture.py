"""The shape of the package, held by tests: imports point one way, the runtime loads only the
plain values, files and functions stay short, and no module reaches into another's private names.

Imports are read from the source with `ast`. Both module-level and function-level imports count
(a function-level import is still a dependency; deferring it only hides a cycle), and so do
imports under ``if TYPE_CHECKING:`` (a type a module names is part of what it depends on).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("autopart", "cost_models")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> dict[str, Path]:
    """Module name -> file, for every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package modules a module imports: ``from a.b import c`` names ``a.b.c`` when that is a
    module, else ``a.b``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    found.add(full)
                elif node.module in modules:
                    found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _sources()
    return {name: _imported(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None. A package's ``__init__`` importing its own
    modules is how a package states its public names, not a dependency back, so those edges are left out."""
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(edges.get(module, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[module] = 2
        stack.pop()
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_runtime_loads_only_the_plain_values():
    """What every rank imports: no pass, solver, predictor, profiler or cost model."""
    code = ("import sys, autopart.runtime.train; "
            "print('\\n'.join(m for m in sys.modules if m.startswith(('autopart', 'cost_models'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                            timeout=120).stdout.split()
    assert "autopart.runtime.train" in loaded
    forbidden = ("autopart.passes", "autopart.solve", "autopart.predict", "autopart.profiling", "autopart.tools",
                 "autopart.codegen", "autopart.driver", "cost_models")
    assert [m for m in loaded if m.startswith(forbidden)] == []


LOWER = {  # package -> what its modules may import of ours: the bottom of the layout
    "autopart.ir": ("autopart.ir",),
    "autopart.schedule": ("autopart.ir", "autopart.schedule"),
    "autopart.runtime": ("autopart.ir", "autopart.schedule", "autopart.runtime"),
}


def test_the_bottom_packages_import_only_what_lies_below_them():
    """The runtime imports only the values and the schedule; the schedule only the values; the
    values nothing of ours. (``autopart`` itself counts as below: it only names the API lazily.)"""
    graph = import_graph()
    for package, allowed in LOWER.items():
        for module in [m for m in graph if m == package or m.startswith(package + ".")]:
            bad = sorted(d for d in graph[module] if not d.startswith(allowed) and d != "autopart")
            assert bad == [], f"{module} imports {bad}"


def test_files_are_short():
    long = {str(p.relative_to(REPO)): n for p in _sources().values() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"files over {MAX_FILE_LINES} lines: {long}; split them by concern"


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int]]:
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit]


def test_functions_are_short():
    long = {str(p.relative_to(REPO)): found for p in _sources().values()
            if (found := long_functions(ast.parse(p.read_text()), MAX_FUNCTION_LINES))}
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_length_checker_counts_a_long_function():
    source = "def f():\n" + "    x = 1\n" * 90
    assert long_functions(ast.parse(source), MAX_FUNCTION_LINES) == [("f", 91)]


def private_imports(tree: ast.AST) -> list[str]:
    """``from x import _name`` of our own packages (torch's ``_pytree`` and the like are torch's business)."""
    return [f"{node.module}.{alias.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


def test_no_private_name_is_imported_across_modules():
    files = [*_sources().values(), *(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"),
             *(REPO / "examples").rglob("*.py")]
    found = {str(p.relative_to(REPO)): names for p in files if (names := private_imports(ast.parse(p.read_text())))}
    assert found == {}, f"private names imported: {found}; make them public where they are an interface"


def test_the_private_import_checker_sees_one():
    assert private_imports(ast.parse("from autopart.driver import _compile")) == ["autopart.driver._compile"]
    assert private_imports(ast.parse("from torch.utils import _pytree")) == []


def test_python_dash_m_autopart_is_the_command_line():
    """``python -m autopart`` runs the same parser as the ``autopart`` script (``autopart.tools.cli:main``)."""
    result = subprocess.run([sys.executable, "-m", "autopart", "--help"], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "compile" in result.stdout and "verify" in result.stdout
