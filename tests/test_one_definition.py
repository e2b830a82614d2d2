"""One meaning per name, one definition per value: a public top-level name (function, class, constant) is defined
in one product module only. A copy of a constant drifts from its home; two things under one name make a reader
open both to learn which is meant.

By design, and so allowed: the members of the stage protocol (every stage module defines run_stage, preflight,
...: pipeline/framework/stage.py) and `main`, a module's command-line entry point."""
from __future__ import annotations

import ast
import inspect
from collections import defaultdict
from pathlib import Path

from bertpipe.pipeline.framework.stage import ReportsHeadline, ReportsStart, StageModule

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("pipeline", "model", "jobs")
BY_DESIGN = {name for protocol in (StageModule, ReportsHeadline, ReportsStart)
             for name, _ in inspect.getmembers(protocol, inspect.isfunction) if not name.startswith("_")} | {"main"}


def public_definitions(source: str) -> set[str]:
    """The public names a module's top level defines (def, class, assignment); imports are not definitions."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and n not in ("log", "logger")}


def test_the_rule_sees_a_copied_constant():
    a = "IGNORE_INDEX = -100\ndef collate(x):\n    return x\nfrom m import SPECIAL\n_private = 1\n"
    assert public_definitions(a) == {"IGNORE_INDEX", "collate"}


def test_every_public_top_level_name_has_one_home():
    homes: dict[str, list[str]] = defaultdict(list)
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            for name in public_definitions(path.read_text()) - BY_DESIGN:
                homes[name].append(str(path.relative_to(REPO)))
    twice = {name: paths for name, paths in homes.items() if len(paths) > 1}
    assert not twice, "defined in more than one module (import it from one home, or name each for what it is):\n" + \
        "\n".join(f"  {name}: {', '.join(paths)}" for name, paths in sorted(twice.items()))
