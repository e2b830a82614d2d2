"""No test is left that no command runs: CI (.ci/run) runs `make test` and `make test-slow`, and the two targets'
marker selections together cover every test, once."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pytest_marker_expression(target: str) -> str:
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, f"no make target {target}"
    found = re.search(r"pytest .*-m (\"[^\"]+\"|\S+)", recipe.group(1))
    assert found, f"make {target} runs no pytest with a marker selection"
    return found.group(1).strip('"')


def test_ci_runs_both_tiers_the_readme_command_first():
    steps = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert "make test" in steps and "make test-slow" in steps, steps
    assert steps.index("make test") == 0, steps


def test_the_two_tiers_together_select_every_test_once():
    fast, slow = _pytest_marker_expression("test"), _pytest_marker_expression("test-slow")
    assert (fast, slow) == ("not slow", "slow")
