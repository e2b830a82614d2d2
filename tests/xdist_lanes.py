"""How the suite shares the machine's cores under pytest-xdist (`make test` and `make test-slow` run `-n 2
--dist loadfile`): most of a test's wall time here is waiting (Ray starting, a node's health checks, a server's
outage), so two workers finish the suite in well under its serial time on 2 cores.

- A test module is one unit of work, on one worker, so its module-scoped fixtures are built once (loadfile).
- The modules that use conftest's `clone` (and so `made_run`: a whole `make run` in a fresh clone, minutes) are one
  unit together: a session fixture is built once per worker that asks for it.
- The modules with a `rig` test (tests/multinode.py: a head and worker nodes, whose health checks and restarts are
  what they measure) are one unit: one rig at a time on the machine (two at once: a rig failed to start).
- The heaviest units are handed out first (those two, then the modules that start Ray or servers), so the last
  minutes of a run are short tests filling both workers, not one long test with a worker idle.

Which modules use `clone` is known only after collection, in the workers: they write it to a file the controller's
scheduler reads (xdist's own `xdist_group` marks no longer reach its scheduler under pytest 9, which ignores the
node ids xdist rewrites). A run without xdist keeps the written order.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

SHARED_CLONE = "clone"  # conftest's session fixture that `made_run` builds on
RIG = "rig"  # the marker of a test that starts the multi-node rig
_UNITS_FILE = "bertpipe_lanes_file"  # the key of the units file in each worker's workerinput


def _unit(module: str, items: list[pytest.Item]) -> tuple[int, str]:
    """(weight, unit): weight 0 for the shared clone's and the rig's units, 1 for a module that starts Ray or a
    server or has a slow test, 2 for the rest; the unit is the module's own unless it shares one."""
    if any(SHARED_CLONE in item.fixturenames for item in items):
        return 0, SHARED_CLONE
    if any(item.get_closest_marker(RIG) for item in items):
        return 0, RIG
    heavy = any(item.get_closest_marker("integration") or item.get_closest_marker("slow") for item in items)
    return (1 if heavy else 2), module


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# -- in each worker -------------------------------------------------------------------------------------------------

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or _UNITS_FILE not in workerinput:
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(_module(item.nodeid), []).append(item)
    placed = {module: _unit(module, its) for module, its in modules.items()}
    ordered = sorted(modules, key=lambda module: placed[module][0])  # stable: the written order within a weight
    items[:] = [item for module in ordered for item in modules[module]]
    units = {module: placed[module][1] for module in ordered}
    target = Path(workerinput[_UNITS_FILE])
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".units-")
    with os.fdopen(fd, "w") as f:
        json.dump(units, f)
    os.replace(tmp, target)  # every worker writes the same map: whichever lands last is whole


# -- in the controller ----------------------------------------------------------------------------------------------

@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's hook, per worker started: where to write the units it collects."""
    node.workerinput[_UNITS_FILE] = str(_units_file(node.config))


def _units_file(config: pytest.Config) -> Path:
    if not hasattr(config, "_bertpipe_units_dir"):
        config._bertpipe_units_dir = tempfile.mkdtemp(prefix="bertpipe-lanes-")
    return Path(config._bertpipe_units_dir) / "units.json"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureUnits(LoadScopeScheduling):
        """loadfile, with the modules of one expensive session fixture as one unit, in the workers' order."""

        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            self._units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:  # asked only once every worker has collected (and written the map)
                path = _units_file(self.config)
                self._units = json.loads(path.read_text()) if path.exists() else {}
            module = _module(nodeid)
            return self._units.get(module, module)

    config.option.loadscopereorder = False  # the workers' order is the schedule: heaviest units first
    return SharedFixtureUnits(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    units_dir = getattr(config, "_bertpipe_units_dir", None)
    if units_dir:
        import shutil

        shutil.rmtree(units_dir, ignore_errors=True)
