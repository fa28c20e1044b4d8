"""Every repository path the documentation names exists.

README.md, docs/*.md, benchmarks/*.md and the docstrings of autotune/**/*.py point the
reader at files; after a file moves, a stale pointer sends a newcomer to nothing. Three
kinds of name are checked:

- a path from the repository root: autotune/..., tests/..., benchmarks/..., docs/...,
  kernels/..., search_spaces/..., .ci/run (globs such as search_spaces/*.yaml must match
  a file);
- a path relative to the package, as the code's docstrings write them:
  runtime/memory.py, estimate/memory.py, parallel/pp_sends.py (found under autotune/);
- a bare module file name (ddp.py), which some file of the repository must carry;

and, in Markdown, every relative link target, from the linking file's folder (its
#anchor a heading of the page linked to). A README section cited by its quoted title
(README, "Commands") must be a heading of the README. A failure lists every missing
name with its file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ROOTED = re.compile(r"(?<![\w./-])((?:autotune|tests|benchmarks|docs|kernels|search_spaces)/[\w./*-]*|\.ci/run\b)")
PACKAGE_RELATIVE = re.compile(
    r"(?<![\w./-])((?:cli|config|plan|estimate|study|launch|runtime|report|export|parallel)/[\w./-]*\.py)\b")
BARE_MODULE = re.compile(r"(?<![\w./*-])(\w+\.py)\b")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
README_SECTION = re.compile(r"README,? \"([^\"]+)\"")

# Names that are not files of this repository, on purpose, each with what it is.
NOT_OURS = {
    "pretrain_gpt.py": "Megatron-LM's training script",
    "pretrain_mamba.py": "Megatron-LM's training script for hybrid Mamba models",
    "activation_checkpoint.py": "torchtitan's activation checkpointing module",
    "docs/performance.md": "torchtitan's benchmark page, cited as a source",
    "benchmarks/GPU.md": "the report benchmarks/gpu_check.py writes when run on a GPU",
}


def repository_files() -> list[str]:
    """The project's files, relative to the root: the folders the documentation points
    into and the files at the root (no virtual environment, build output or cache)."""
    files = [p.name for p in ROOT.iterdir() if p.is_file()]
    for top in ("autotune", "tests", "benchmarks", "docs", "kernels", "search_spaces", ".ci"):
        files += [str(p.relative_to(ROOT)) for p in (ROOT / top).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts]
    return files


FILES = repository_files()
README_HEADINGS = {line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines()
                   if line.startswith("#")}
BASENAMES = {Path(f).name for f in FILES}


def exists(path: str) -> bool:
    path = path.rstrip(".,:;")
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def resolves_in_package(path: str) -> bool:
    return any(f.endswith("/" + path) and f.startswith("autotune/") for f in FILES)


def anchors(markdown: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as -."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.read_text().splitlines() if line.startswith("#")}


def missing_in(text: str, first_line: int, where: Path) -> list[tuple[int, str]]:
    """(line, name) of each name in `text` that names no file of the repository."""
    missing = []
    for number, line in enumerate(text.splitlines(), start=first_line):
        for match in ROOTED.finditer(line):
            name = match.group(1).rstrip(".,:;")
            if name.rstrip("/") in ("autotune", "tests", "benchmarks", "docs", "kernels", "search_spaces"):
                continue
            if not exists(name) and name not in NOT_OURS:
                missing.append((number, name))
        for match in PACKAGE_RELATIVE.finditer(line):
            if not resolves_in_package(match.group(1)):
                missing.append((number, match.group(1)))
        for match in BARE_MODULE.finditer(line):
            name = match.group(1)
            if name not in BASENAMES and name not in NOT_OURS:
                missing.append((number, name))
        for match in README_SECTION.finditer(line):
            if match.group(1) not in README_HEADINGS:
                missing.append((number, f'README section "{match.group(1)}"'))
        if where.suffix == ".md":
            for match in MARKDOWN_LINK.finditer(line):
                target, _, anchor = match.group(1).partition("#")
                if re.match(r"^[a-z]+:", target):
                    continue
                linked = where.parent / target if target else where
                if not linked.exists():
                    missing.append((number, f"link {target}"))
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    missing.append((number, f"link {match.group(1)} (no such heading)"))
    return missing


def docstrings(source: str):
    """(first line, text) of every module, class and function docstring."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                yield body[0].lineno, body[0].value.value


def documents() -> list[Path]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
    return [p for p in paths if p.exists()]


def modules() -> list[Path]:
    return sorted(ROOT / f for f in FILES if f.startswith("autotune/") and f.endswith(".py"))


def test_the_checker_finds_a_missing_path_and_its_line():
    text = "see `autotune/estimate/memory.py`\nand runtime/support.py, estimate_memory.py, tests/nowhere/\n"
    assert missing_in(text, 10, ROOT / "README.md") == [
        (11, "tests/nowhere/"), (11, "runtime/support.py"), (11, "estimate_memory.py")]
    assert missing_in("[r](../benchmarks/RESULTS.md) [x](gone.md)", 1, ROOT / "docs" / "a.md") == [(1, "link gone.md")]
    assert missing_in("[s](runtime.md#pipeline-parallel) [t](runtime.md#no-such)", 1, ROOT / "docs" / "a.md") == [
        (1, "link runtime.md#no-such (no such heading)")]
    assert missing_in('README, "Commands"; README "Estimator"', 1, ROOT / "x.py") == [(1, 'README section "Estimator"')]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(path):
    missing = missing_in(path.read_text(), 1, path)
    rel = path.relative_to(ROOT)
    assert not missing, "names of files that do not exist:\n" + "\n".join(f"{rel}:{n}: {name}" for n, name in missing)


def test_every_path_a_docstring_names_exists():
    missing = []
    for path in modules():
        for first_line, text in docstrings(path.read_text()):
            for number, name in missing_in(text, first_line, path):
                missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "docstrings name files that do not exist:\n" + "\n".join(missing)
