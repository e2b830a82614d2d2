"""tests/xdist_lanes.py under a real pytest-xdist run of a toy suite: a session fixture shared through conftest's
`clone` is built once although its modules are spread over two workers' worth of work, each module's module-scoped
fixture once too, and the modules of `rig` tests run on one worker (one after the other); the units measured
longest start first, and a run can record its tests' seconds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = '''
import os, sys
import pytest
sys.path.insert(0, {tests!r})
pytest_plugins = ["xdist_lanes"]

def _built(name):
    with open(os.path.join(os.environ["LANES_LOG"]), "a") as f:
        f.write(name + " " + os.environ.get("PYTEST_XDIST_WORKER", "-") + "\\n")

@pytest.fixture(scope="session")
def clone():
    _built("clone")

@pytest.fixture(scope="module")
def per_module(request):
    _built("module " + request.module.__name__)
'''

MODULE = '''
import time
import pytest

@pytest.mark.parametrize("k", range(4))
def test_it({fixtures}, k):
    time.sleep(0.05)
'''


def _toy_suite(root: Path) -> None:
    (root / "conftest.py").write_text(CONFTEST.format(tests=str(TESTS)))
    for name in ("test_a", "test_b", "test_c"):
        (root / f"{name}.py").write_text(MODULE.format(fixtures="clone, per_module"))
    for name in ("test_d", "test_e", "test_f"):
        (root / f"{name}.py").write_text(MODULE.format(fixtures="per_module"))
    for name in ("test_g", "test_h"):
        (root / f"{name}.py").write_text("import pytest\npytestmark = pytest.mark.rig\n"
                                         + MODULE.format(fixtures="per_module"))


def _run_toy_suite(root: Path, **env: str) -> list[list[str]]:
    """Runs it on two xdist workers; the fixtures built, in the order each worker built them: [name..., worker]."""
    log = root / "built.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", str(root)],
                          cwd=root, env={"LANES_LOG": str(log), "PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "32 passed" in done.stdout, done.stdout
    return [line.split() for line in log.read_text().splitlines()]


def test_the_shared_clone_and_each_module_fixture_are_built_once(tmp_path):
    _toy_suite(tmp_path)
    built = _run_toy_suite(tmp_path)
    names = [b[:-1] for b in built]
    assert names.count(["clone"]) == 1, built
    for module in "abcdefgh":
        assert names.count(["module", f"test_{module}"]) == 1, built
    clone_worker = next(b[-1] for b in built if b[0] == "clone")
    assert {b[-1] for b in built if b[0] == "module" and b[1] in ("test_a", "test_b", "test_c")} == {clone_worker}
    assert len({b[-1] for b in built if b[0] == "module" and b[1] in ("test_g", "test_h")}) == 1, built
    assert {b[-1] for b in built} == {"gw0", "gw1"}, built  # both workers had work


def test_the_units_measured_longest_start_first_and_a_run_records_its_seconds(tmp_path):
    """Unmeasured, the rig's unit (marked: a minute a test) and the shared clone's start first; measured, test_e's
    unit is the longest and test_d's comes next, so test_e starts at once on one worker, the rig's unit on the
    other. The run writes every test's seconds into the recording file, keeping what it held for other tests."""
    _toy_suite(tmp_path)
    (tmp_path / "tests").mkdir()
    seconds = {f"test_e.py::test_it[{k}]": 200.0 for k in range(4)} | {f"test_d.py::test_it[{k}]": 50.0
                                                                      for k in range(4)}
    (tmp_path / "tests" / "lane_seconds.json").write_text(json.dumps(seconds))
    record = tmp_path / "recorded.json"
    record.write_text(json.dumps({"test_gone.py::test_old": 7.0}))
    built = _run_toy_suite(tmp_path, BERTPIPE_LANE_SECONDS=str(record))
    first = {}
    for *name, worker in built:
        first.setdefault(worker, name)
    assert sorted(first.values()) == [["module", "test_e"], ["module", "test_g"]], built
    recorded = json.loads(record.read_text())
    assert set(recorded) == {"test_gone.py::test_old"} | {f"test_{m}.py::test_it[{k}]" for m in "abcdefgh"
                                                           for k in range(4)}
    assert recorded["test_gone.py::test_old"] == 7.0
    assert all(isinstance(v, float) and v >= 0 for v in recorded.values())
