"""House rules that keep the code walkable: every module imports, no import circle (late imports included), no
function over 60 lines, the project imported only under the `bertpipe` name it installs, and ruff (120 columns,
pyflakes: [tool.ruff] in pyproject.toml) silent on the code, the tests and the benchmarks."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "model", "jobs")
MAX_FUNCTION_LINES = 60
LINTED = (*PACKAGES, "tests", "benchmarks")


def modules() -> dict[str, Path]:
    """bertpipe.<package>.<...> name -> file, for every module of the three packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(("bertpipe",) + (parts[:-1] if parts[-1] == "__init__" else parts))
            out[name] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports anywhere in the file (functions included: a late import still closes a
    circle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_every_module_imports():
    for name in modules():
        importlib.import_module(name)


def test_no_import_cycles():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    # A package's __init__ re-exporting its own modules is not a circle with them.
    graph = {n: {t for t in deps if not n.startswith(t + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_function_longer_than_60_lines():
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_project_is_imported_only_as_bertpipe():
    bare = []
    for path in [*modules().values(), *(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            bare += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert not bare, bare


def test_every_package_folder_is_installed():
    """A wheel (the cluster image, `pip install .`) holds only the packages pyproject.toml lists: a new folder missing
    there imports in the editable checkout and fails on the cluster."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    # A package of data alone (the presets: bertpipe.configs = configs/) has no __init__.py to be found by.
    data_only = {name for name, folder in setuptools["package-dir"].items()
                 if not (REPO / folder / "__init__.py").exists()}
    listed = set(setuptools["packages"]) - data_only
    folders = {".".join(("bertpipe",) + init.parent.relative_to(REPO).parts)
               for top in ("pipeline", "model", "jobs") for init in (REPO / top).rglob("__init__.py")}
    assert folders == listed, (sorted(folders - listed), sorted(listed - folders))


def test_ruff_reports_nothing():
    """Line length and pyflakes (unused imports and variables, undefined names...) as configured in pyproject.toml;
    --no-cache: no .ruff_cache written into the working tree."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format=concise", *LINTED],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff findings ([tool.ruff] in pyproject.toml):\n{proc.stdout}{proc.stderr}"


FINE_TUNING_TASKS = ("glue", "squad", "ner", "features")


def test_fine_tuning_tasks_are_siblings_above_one_engine():
    """GLUE, SQuAD, NER (and feature extraction) each import the engine (bertpipe.jobs.tuning) and never each
    other; the engine imports none of them."""
    mods = modules()
    known = set(mods)
    sideways = []
    for name, path in mods.items():
        parts = name.split(".")
        if len(parts) < 3 or parts[1] != "jobs" or parts[2] not in (*FINE_TUNING_TASKS, "tuning"):
            continue
        for target in imports_of(name, path, known):
            tparts = target.split(".")
            other = tparts[2] if len(tparts) > 2 and tparts[1] == "jobs" else ""
            if other in FINE_TUNING_TASKS and other != parts[2]:
                sideways.append(f"{name} imports {target}")
    assert not sideways, sideways
    users = {n.split(".")[2] for n, p in mods.items() if n.split(".")[1:2] == ["jobs"] and len(n.split(".")) > 3
             and any(t.startswith("bertpipe.jobs.tuning") for t in imports_of(n, p, known))}
    assert set(FINE_TUNING_TASKS) <= users, users
