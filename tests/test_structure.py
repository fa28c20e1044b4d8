"""The code's shape: no import cycles, one home for the schedule names, the controller
free of the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

from autotune.plan.schedules import SCHEDULES

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
    assert set(holders) <= {"autotune.plan.schedules"}, holders


# The districts of the package, lowest first, and what each may import. A district is a
# sub-package (or one of the few modules at the root); the order is the architecture: the
# model description, the plan, the estimator, the record of a study, then what runs trials
# (launch, runtime) and what reads the record (export, report), the study itself, the CLI.
DISTRICT_IMPORTS = {
    "errors": set(),
    "config": {"errors"},
    "plan": {"errors", "config"},
    "estimate": {"errors", "config", "plan"},
    "trialspec": set(),
    "record": {"errors", "config", "plan", "trialspec"},
    "launch": {"errors", "trialspec", "record"},
    "torch_compat": set(),
    "runtime": {"errors", "config", "plan", "trialspec", "record", "kernels", "torch_compat"},
    "kernels": {"torch_compat"},
    "export": {"errors", "config", "plan", "estimate", "record"},
    "report": {"errors", "config", "plan", "estimate", "record", "export"},
    "study": {"errors", "config", "plan", "estimate", "record", "trialspec", "launch", "export", "report"},
    "cli": {"errors", "config", "plan", "estimate", "record", "trialspec", "launch", "export", "report", "study"},
}


def district(module: str) -> str:
    """autotune.<district>[.module]; the kernels; the private torch APIs, which the kernels and
    the runtime share (runtime/torch_compat.py), as a district of their own."""
    if module.startswith("autotune_kernels"):
        return "kernels"
    if module == "autotune.runtime.torch_compat":
        return "torch_compat"
    name = module.split(".")[1]
    return {"__main__": "cli", "search_spaces": "plan"}.get(name, name)


def test_every_module_belongs_to_a_district():
    unknown = sorted(m for m in project_modules() if m != "autotune" and district(m) not in DISTRICT_IMPORTS)
    assert not unknown, f"modules outside every district (add them to DISTRICT_IMPORTS): {unknown}"


def test_districts_import_only_the_layers_below_them():
    broken = []
    for name, targets in import_graph().items():
        if name == "autotune":
            continue
        mine = district(name)
        for target in targets:
            theirs = district(target)
            if theirs != mine and theirs not in DISTRICT_IMPORTS[mine]:
                broken.append(f"{name} ({mine}) imports {target} ({theirs})")
    assert not broken, "\n".join(sorted(broken))


def test_the_package_root_holds_few_modules():
    """The root holds the CLI and the shared vocabulary; everything else lives in its district."""
    root = sorted(p.name for p in (ROOT / "autotune").glob("*.py"))
    assert len(root) <= 10, root


def test_no_folder_at_the_repository_root_shadows_an_installed_package():
    """Commands and tests run from the repository root, where the root is on sys.path: a
    folder there that is a regular package would hide an installed one of its name (PyPI's
    `kernels`, which transformers imports). kernels/ is a plain folder installed as
    autotune_kernels; the installed import must keep working."""
    regular = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert regular == ["autotune", "search_spaces"], regular
    import autotune_kernels.attention

    assert Path(autotune_kernels.attention.__file__).resolve().parent == ROOT / "kernels"


def test_closed_sets_name_exactly_what_their_tables_hold():
    """The Literal types the type checker reads are the tables the code looks names up in."""
    from typing import get_args

    from autotune.plan.schedules import ScheduleName

    assert set(get_args(ScheduleName)) == set(SCHEDULES)
