"""How the suite shares the machine's cores under pytest-xdist (`make test` and `make test-slow` run `-n 2
--dist loadfile`): most of a test's wall time here is waiting (Ray starting, a node's health checks, a server's
outage), so two workers finish the suite in well under its serial time on 2 cores.

- A test module is one unit of work, on one worker, so its module-scoped fixtures are built once (loadfile).
- The modules that use conftest's `clone` (and so `made_run`: a whole `make run` in a fresh clone, minutes) are one
  unit together: a session fixture is built once per worker that asks for it.
- The modules with a `rig` test (tests/multinode.py: a head and worker nodes, whose health checks and restarts are
  what they measure) are one unit: one rig at a time on the machine (two at once: a rig failed to start).
- The longest units are handed out first, so the last minutes of a run are short tests filling both workers, not
  one long test with a worker idle. A unit's length is the sum of its selected tests' seconds in
  tests/lane_seconds.json (measured under two workers; a test not in it counts by its markers: a minute if it
  starts Ray or a server or is slow, next to nothing otherwise). `BERTPIPE_LANE_SECONDS=path` makes a run write
  its tests' seconds there, merged into what the file holds:
  `BERTPIPE_LANE_SECONDS=tests/lane_seconds.json make test test-slow` refreshes it.

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
MEASURED = Path("tests") / "lane_seconds.json"  # under the rootdir
RECORD_ENV = "BERTPIPE_LANE_SECONDS"
UNMEASURED_HEAVY_S, UNMEASURED_LIGHT_S = 60.0, 0.5


def _unit(module: str, items: list[pytest.Item]) -> str:
    """The module's own unit unless it shares one: the shared clone's or the rig's."""
    if any(SHARED_CLONE in item.fixturenames for item in items):
        return SHARED_CLONE
    if any(item.get_closest_marker(RIG) for item in items):
        return RIG
    return module


def _seconds(item: pytest.Item, measured: dict[str, float]) -> float:
    if item.nodeid in measured:
        return measured[item.nodeid]
    heavy = any(item.get_closest_marker(m) for m in ("integration", "slow", RIG))
    return UNMEASURED_HEAVY_S if heavy else UNMEASURED_LIGHT_S


def _read_measured(path: Path) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no file or an unreadable one: the markers alone order the units


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# -- in each worker -------------------------------------------------------------------------------------------------

@pytest.hookimpl(trylast=True)  # after `-m` has deselected: a unit's length counts only the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or _UNITS_FILE not in workerinput:
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(_module(item.nodeid), []).append(item)
    units = {module: _unit(module, its) for module, its in modules.items()}
    measured = _read_measured(config.rootpath / MEASURED)
    length: dict[str, float] = {}
    for module, its in modules.items():
        length[units[module]] = length.get(units[module], 0.0) + sum(_seconds(i, measured) for i in its)
    # longest unit first, a unit's modules together; stable: the written order among equals
    ordered = sorted(modules, key=lambda module: -length[units[module]])
    items[:] = [item for module in ordered for item in modules[module]]
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

    config.option.loadscopereorder = False  # the workers' order is the schedule: longest units first
    return SharedFixtureUnits(config, log)


_recorded: dict[str, float] = {}  # nodeid -> seconds, when a run records them (BERTPIPE_LANE_SECONDS)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sums each test's set-up, call and tear-down seconds; the controller under xdist sees every worker's reports
    (and writes them at the session's end)."""
    if os.environ.get(RECORD_ENV):
        _recorded[report.nodeid] = _recorded.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get(RECORD_ENV)
    if not target or hasattr(session.config, "workerinput") or not _recorded:
        return
    merged = _read_measured(Path(target)) | {nodeid: round(s, 1) for nodeid, s in _recorded.items()}
    Path(target).write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    units_dir = getattr(config, "_bertpipe_units_dir", None)
    if units_dir:
        import shutil

        shutil.rmtree(units_dir, ignore_errors=True)
