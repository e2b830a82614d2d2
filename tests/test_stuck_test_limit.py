"""A test that hangs must not hang CI: past pyproject.toml's per-test limit (pytest-timeout) it fails with the stacks
of its threads and the run goes on, also on `make test`'s two xdist workers; and the limit is far above what any
healthy test measured takes, so it fails only what is stuck."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STUCK = '''
import threading, time

def test_stuck():
    threading.Event().wait()  # what a read on a pipe nobody writes to looks like

def test_healthy():
    assert True
'''


def _limit_s() -> float:
    ini = (REPO / "pyproject.toml").read_text().split("[tool.pytest.ini_options]", 1)[1].split("\n[", 1)[0]
    found = re.search(r"^timeout = (\d+)$", ini, re.M)
    assert found, "pyproject.toml's [tool.pytest.ini_options] sets no per-test timeout"
    return float(found.group(1))


def test_a_stuck_test_fails_at_the_limit_with_its_stack_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_toy.py").write_text(STUCK)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 3\n")  # the project's setting, scaled down
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "Timeout" in out and "test_stuck" in out, out
    assert "threading.Event().wait()" in out, out  # the stack says where it was stuck


def test_the_limit_is_far_above_the_longest_test_measured():
    measured = json.loads((REPO / "tests" / "lane_seconds.json").read_text())
    longest = max(measured.values())
    assert _limit_s() >= 2 * longest, (longest, _limit_s())
