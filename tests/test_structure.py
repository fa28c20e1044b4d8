"""The code's shape: no import cycles, one home for the schedule names, the controller
free of the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

from autotune.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"autotune": ROOT / "autotune", "autotune_kernels": ROOT / "kernels"}


def project_modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the distribution."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its file (inside functions too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            # `from package import submodule` imports the submodule; anything else, the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_controller_never_imports_the_runtime():
    """autotune run's process never joins a process group: nothing outside the runtime
    (and the kernels it calls) imports it."""
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith(("autotune.runtime", "autotune_kernels")):
            continue
        runtime = sorted(t for t in targets if t.startswith(("autotune.runtime", "autotune_kernels")))
        assert not runtime, f"{name} imports {runtime}"


def string_literals(path: Path) -> set[str]:
    """Every string constant of a file, docstrings included."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_schedule_names_live_in_one_table():
    holders = {}
    for name, path in project_modules().items():
        literals = string_literals(path)
        named = {s for s in SCHEDULES if any(s == text or f" {s} " in f" {text} " for text in literals)}
        if named:
            holders[name] = sorted(named)
    assert set(holders) <= {"autotune.schedules"}, holders
