"""tests/xdist_lanes.py under a real pytest-xdist run of a toy suite: a session fixture shared through conftest's
`clone` is built once although its modules are spread over two workers' worth of work, each module's module-scoped
fixture once too, and the modules of `rig` tests run on one worker (one after the other)."""
from __future__ import annotations

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


def test_the_shared_clone_and_each_module_fixture_are_built_once(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST.format(tests=str(TESTS)))
    for name in ("test_a", "test_b", "test_c"):
        (tmp_path / f"{name}.py").write_text(MODULE.format(fixtures="clone, per_module"))
    for name in ("test_d", "test_e", "test_f"):
        (tmp_path / f"{name}.py").write_text(MODULE.format(fixtures="per_module"))
    for name in ("test_g", "test_h"):
        (tmp_path / f"{name}.py").write_text("import pytest\npytestmark = pytest.mark.rig\n"
                                             + MODULE.format(fixtures="per_module"))
    log = tmp_path / "built.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", str(tmp_path)],
                          cwd=tmp_path, env={"LANES_LOG": str(log), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "32 passed" in done.stdout, done.stdout
    built = [line.split() for line in log.read_text().splitlines()]
    names = [b[:-1] for b in built]
    assert names.count(["clone"]) == 1, built
    for module in "abcdefgh":
        assert names.count(["module", f"test_{module}"]) == 1, built
    clone_worker = next(b[-1] for b in built if b[0] == "clone")
    assert {b[-1] for b in built if b[0] == "module" and b[1] in ("test_a", "test_b", "test_c")} == {clone_worker}
    assert len({b[-1] for b in built if b[0] == "module" and b[1] in ("test_g", "test_h")}) == 1, built
    assert {b[-1] for b in built} == {"gw0", "gw1"}, built  # both workers had work
